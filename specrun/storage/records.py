"""Per-prompt records of a job: output rows (outputs.OutputStore), done and failed markers, live progress (JSON).

Finishing a prompt (write_output): its output row, durable, in a part file; then its done marker; then its failed
and live files go, and (drop_progress) its progress chunks: every token is in the durable row now (I3). Compaction
merges parts into merged files, which are their own completion record: the done markers of merged parts go with the
parts. A prompt is done iff its row is in a readable output file. A done marker without one ("repair" in status) is
dropped by repair() and the prompt generated again: from its chunks if it still has them, else from the start (the
same tokens either way: I2). Markers and live files are rebuilt after a crash, so they are written without fsync.
"""

from __future__ import annotations

import contextlib
import json

import pyarrow as pa

from specrun.storage import merging
from specrun.storage.atomic import atomic_write_json, read_json
from specrun.storage.chunks import progress_count
from specrun.storage.fs import fs_of, job_path
from specrun.storage.names import id_key
from specrun.storage.outputs import Compaction, OutputStore, Scan, order_key
from specrun.storage.rowfiles import row_checksum
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
        "checksum": row_checksum(prompt_id, token_ids, text, finish_reason),
    }
    for n in range(1, 5):
        row[f"distinct_{n}"] = distinct_n(token_ids, n)
    return row


class Records:
    """Paths and readers/writers for outputs/, done/, failed/, live/ and progress/ of one job directory."""

    def __init__(self, root, job_ids=None, job_stamp=None):
        """job_ids: () -> the job's prompt ids, job_stamp: () -> its identity (each read once, when outputs/ is first
        used): files in outputs/ holding other prompts' rows or stamped by another job are foreign and left alone;
        None: every row there counts."""
        self.root = root = job_path(root)
        self.fs = fs_of(root)
        self.outputs, self.done, self.failed, self.live = (root / n for n in ("outputs", "done", "failed", "live"))
        self.progress = root / "progress"
        self._job_ids, self._job_keys = job_ids, None
        self._job_stamp, self._stamp = job_stamp, None
        self.store = OutputStore(self.outputs, self.job_keys if job_ids is not None else None,
                                 self.job_stamp if job_stamp is not None else None)

    def job_keys(self) -> set[str]:
        if self._job_keys is None:
            self._job_keys = {id_key(i) for i in self._job_ids()}
        return self._job_keys

    def job_stamp(self) -> str | None:
        if self._stamp is None:
            self._stamp = self._job_stamp() or ""
        return self._stamp or None

    def output_path(self, prompt_id: str):
        """The part file a prompt's row is written to (merged later into a merged file)."""
        return self.store.part_path(prompt_id)

    def write_output(self, row: dict) -> None:
        """Output row first (durable), then the done marker; a rerun replaces the same part (never a duplicate)."""
        key = id_key(row["id"])
        self.store.write_part(row)
        atomic_write_json(self.done / f"{key}.json", {"id": row["id"], "n_tokens": row["n_tokens"],
                                                     "output": f"outputs/{key}.parquet"}, durable=False)
        self.fs.delete(self.failed / f"{key}.json")
        self.fs.delete(self.live / f"{key}.json")

    def checkpointed(self):
        """prompt id -> its checkpointed tokens, from chunk file names (cheap, not validated) and one listing of
        progress/ made now."""
        have = set(self.fs.list(self.progress))
        return lambda pid: progress_count(self.progress / key) if (key := id_key(pid)) in have else 0

    def drop_progress(self, prompt_id: str) -> None:
        """Remove a finished prompt's progress chunks: call only once its output row is durable."""
        self.fs.delete_tree(self.progress / id_key(prompt_id))

    # -- before a run (the driver, under the job lock) -------------------------------------------------------------
    def repair(self, ids: list[str]) -> Scan:
        """Make the records agree with the readable output rows (see merging.repair): markers of rows that are not
        readable are dropped (regenerate), missing markers of parts written, markers of merged rows removed; progress
        chunks of done prompts and every live file (no run is going on) removed. Returns the scan of done rows."""
        keymap = {id_key(i): i for i in ids}
        problems = merging.repair(self.store, keymap, order_key({i: n for n, i in enumerate(ids)}))
        scan = self.store.scan(keymap)
        scan.problems[:0] = problems
        markers = self._keys(self.done, ".json")
        for key in markers:
            pid = keymap.get(key)
            if pid is not None and pid not in scan.in_parts:
                self.fs.delete(self.done / f"{key}.json")
        for pid in scan.in_parts - {keymap[k] for k in markers if k in keymap}:
            atomic_write_json(self.done / f"{id_key(pid)}.json", {"id": pid, "n_tokens": scan.rows[pid]["n_tokens"],
                                                                  "output": f"outputs/{id_key(pid)}.parquet"},
                              durable=False)
        for key in self._keys(self.progress, ""):
            if keymap.get(key) in scan.rows:
                with contextlib.suppress(OSError):
                    self.fs.delete_tree(self.progress / key)
        for key in self._keys(self.live, ".json"):
            self.fs.delete(self.live / f"{key}.json")
        return scan

    def compact(self, ids: list[str], part_ids=None, everything: bool = False, cancel=None) -> Compaction:
        """merging.compact over this job's prompts (`ids` in input order); merged parts lose their markers."""
        res = merging.compact(self.store, {id_key(i): i for i in ids}, order_key({i: n for n, i in enumerate(ids)}),
                             part_ids, everything, cancel)
        for pid in res.merged_parts:
            self.fs.delete(self.done / f"{id_key(pid)}.json")
        return res

    # -- reading ------------------------------------------------------------------------------------------------
    def scan(self, ids: list[str] | None = None, columns=("id", "n_tokens"), verify: bool = False) -> Scan:
        return self.store.scan({id_key(i): i for i in ids or ()}, columns, verify)

    def iter_outputs(self, ids: list[str] | None = None, columns=None, problems: list | None = None,
                     batches: bool = False):
        """(id, 1-row table) of every finished row, in the order of `ids` (input order), streamed; with `batches`,
        (ids, table) of several rows at a time."""
        ids = list(ids or ())
        yield from self.store.rows({id_key(i): i for i in ids}, order_key({i: n for n, i in enumerate(ids)}),
                                   columns, problems, batches)

    def read_outputs(self, ids: list[str] | None = None) -> pa.Table:
        """Every finished row in one table (small jobs and tests; export streams instead)."""
        tables = [t for _, t in self.iter_outputs(ids)]
        return pa.concat_tables(tables) if tables else OUTPUT.empty_table()

    def is_done(self, prompt_id: str) -> bool:
        """Whether its row is in a readable output file (scans outputs/: for one-off checks, not loops)."""
        return prompt_id in self.scan([prompt_id]).rows

    def marker_keys(self) -> set[str]:
        return self._keys(self.done, ".json")

    def read_done(self, prompt_id: str) -> dict | None:
        return _read_or_none(self.done / f"{id_key(prompt_id)}.json")

    def output_problem(self, prompt_id: str) -> str:
        """Why a prompt with a done marker has no readable row (for status)."""
        path = self.output_path(prompt_id)
        return f"output file {path.name} is {'unreadable' if self.fs.exists(path) else 'missing'}"

    def mark_failed(self, prompt_id: str, error: str, attempts: int) -> None:
        info = {"id": prompt_id, "error": error, "attempts": attempts}
        atomic_write_json(self.failed / f"{id_key(prompt_id)}.json", info)
        self.fs.delete(self.live / f"{id_key(prompt_id)}.json")

    def failure(self, prompt_id: str) -> dict | None:
        p = self.failed / f"{id_key(prompt_id)}.json"
        return _read_or_none(p)

    def clear_failed(self, prompt_id: str) -> None:
        self.fs.delete(self.failed / f"{id_key(prompt_id)}.json")

    def write_live(self, prompt_id: str, info: dict) -> None:
        atomic_write_json(self.live / f"{id_key(prompt_id)}.json", {"id": prompt_id, **info}, durable=False)

    def read_live(self, prompt_id: str) -> dict | None:
        return _read_or_none(self.live / f"{id_key(prompt_id)}.json")

    def clear_live(self, prompt_id: str) -> None:
        self.fs.delete(self.live / f"{id_key(prompt_id)}.json")

    def _keys(self, directory, suffix: str) -> set[str]:
        """File keys in a directory (names minus `suffix`; hidden names and other suffixes skipped)."""
        n = len(suffix)
        return {x[:len(x) - n] for x in self.fs.list(directory)
                if not x.startswith(".") and x.endswith(suffix) and "." not in x[:len(x) - n]}


def _read_or_none(path) -> dict | None:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None
