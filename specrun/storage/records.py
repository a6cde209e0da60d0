"""Per-prompt records of a job: output rows (Parquet), done/failed markers and live progress (JSON).

The done marker is written only after the output row is durable; outputs are one file per prompt id (exactly once).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_json, atomic_write_table, read_json
from specrun.storage.names import id_key
from specrun.storage.schemas import OUTPUT


def distinct_n(tokens: list[int], n: int) -> float:
    """Distinct n-grams / all n-grams of the output (0 when shorter than n)."""
    total = len(tokens) - n + 1
    if total <= 0:
        return 0.0
    return len(set(zip(*(tokens[i:] for i in range(n))))) / total


def output_row(prompt_id: str, token_ids: list[int], text: str, finish_reason: str, stats: dict, *,
               prompt_tokens: int, resumed_tokens: int, attempts: int) -> dict:
    row = {
        "id": prompt_id, "token_ids": token_ids, "text": text, "finish_reason": finish_reason,
        "n_tokens": len(token_ids), "prompt_tokens": prompt_tokens, "resumed_tokens": resumed_tokens,
        "seconds": float(stats.get("seconds", 0.0)), "steps": int(stats.get("steps", 0)),
        "mean_accepted": float(stats.get("mean_accepted", 0.0)), "tokens_per_s": float(stats.get("tokens_per_s", 0.0)),
        "attempts": attempts, "stats": json.dumps(stats, sort_keys=True),
    }
    for n in range(1, 5):
        row[f"distinct_{n}"] = distinct_n(token_ids, n)
    return row


class Records:
    """Paths and readers/writers for outputs/, done/, failed/ and live/ of one job directory."""

    def __init__(self, root: Path):
        self.root = root
        self.outputs, self.done, self.failed, self.live = (root / n for n in ("outputs", "done", "failed", "live"))

    def output_path(self, prompt_id: str) -> Path:
        return self.outputs / f"{id_key(prompt_id)}.parquet"

    def write_output(self, row: dict) -> None:
        """Output row first (durable), then the done marker; a rerun overwrites the same file (never a duplicate)."""
        key = id_key(row["id"])
        atomic_write_table(self.outputs / f"{key}.parquet", pa.Table.from_pylist([row], schema=OUTPUT))
        atomic_write_json(self.done / f"{key}.json", {"id": row["id"], "n_tokens": row["n_tokens"],
                                                     "output": f"outputs/{key}.parquet"})
        (self.failed / f"{key}.json").unlink(missing_ok=True)
        (self.live / f"{key}.json").unlink(missing_ok=True)

    def output_problem(self, prompt_id: str) -> str | None:
        """None when the prompt's output file is readable and holds its row; else what is wrong with it. Reads the
        footer and the small id column only (cheap at any output length)."""
        path = self.output_path(prompt_id)
        try:
            t = pq.read_table(path, columns=["id", "n_tokens"], schema=OUTPUT)
        except FileNotFoundError:
            return f"output file {path.name} is missing"
        except Exception as e:  # truncated, not Parquet, wrong schema, I/O error
            return f"output file {path.name} is unreadable ({type(e).__name__}: {str(e)[:200]})"
        if t.num_rows != 1 or t.column("id")[0].as_py() != prompt_id:
            return f"output file {path.name} does not hold this prompt's row"
        return None

    def repair_marker(self, prompt_id: str) -> bool:
        """True if the prompt is done: its output row is readable. A durable output without its marker (crash in
        between) gets its marker; a marker without a readable output is dropped (the output moved aside as
        `.corrupt` when present) so that the prompt is generated again from its checkpoints."""
        marker = self.done / f"{id_key(prompt_id)}.json"
        problem = self.output_problem(prompt_id)
        if problem is not None:
            if marker.exists():
                path = self.output_path(prompt_id)
                if path.exists():
                    os.replace(path, path.with_name(path.name + ".corrupt"))
                marker.unlink(missing_ok=True)
            return False
        if not marker.exists():
            t = pq.read_table(self.output_path(prompt_id), columns=["n_tokens"], schema=OUTPUT)
            atomic_write_json(marker, {"id": prompt_id, "n_tokens": t.column("n_tokens")[0].as_py(),
                                       "output": f"outputs/{self.output_path(prompt_id).name}"})
        return True

    def read_done(self, prompt_id: str) -> dict | None:
        return _read_or_none(self.done / f"{id_key(prompt_id)}.json")

    def is_done(self, prompt_id: str) -> bool:
        return (self.done / f"{id_key(prompt_id)}.json").exists()

    def mark_failed(self, prompt_id: str, error: str, attempts: int) -> None:
        info = {"id": prompt_id, "error": error, "attempts": attempts}
        atomic_write_json(self.failed / f"{id_key(prompt_id)}.json", info)
        (self.live / f"{id_key(prompt_id)}.json").unlink(missing_ok=True)

    def failure(self, prompt_id: str) -> dict | None:
        p = self.failed / f"{id_key(prompt_id)}.json"
        return _read_or_none(p)

    def clear_failed(self, prompt_id: str) -> None:
        (self.failed / f"{id_key(prompt_id)}.json").unlink(missing_ok=True)

    def write_live(self, prompt_id: str, info: dict) -> None:
        atomic_write_json(self.live / f"{id_key(prompt_id)}.json", {"id": prompt_id, **info})

    def read_live(self, prompt_id: str) -> dict | None:
        return _read_or_none(self.live / f"{id_key(prompt_id)}.json")

    def clear_live(self, prompt_id: str) -> None:
        (self.live / f"{id_key(prompt_id)}.json").unlink(missing_ok=True)

    def read_outputs(self) -> pa.Table:
        """All finished rows (those with a done marker and a readable output), in file-name order. A marker whose
        output is missing or unreadable is skipped (status shows it as needing repair; resume regenerates it)."""
        tables = []
        if self.done.is_dir():
            for marker in sorted(self.done.glob("*.json")):
                try:
                    t = pq.read_table(self.outputs / f"{marker.stem}.parquet", schema=OUTPUT)
                except Exception:
                    continue
                tables.append(t)
        return pa.concat_tables(tables) if tables else OUTPUT.empty_table()


def _read_or_none(path: Path) -> dict | None:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None
