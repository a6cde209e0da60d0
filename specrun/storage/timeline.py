"""Per-prompt timelines: JOB/timeline/<id key>.parquet (schemas.TIMELINE), one row per checkpoint chunk and one for the
tokens after the last chunk, so that `specrun report` sees a running, interrupted or resumed prompt as it went.

Written by the prompt's worker, rewritten whole (atomically) at each checkpoint: O(chunks) per write, beside a chunk of
checkpoint_every tokens. Not under progress/, so it outlives the chunks that finished prompts drop and compaction.
Rows of tokens that a resume regenerates (chunks set aside, or never written) are dropped when the next attempt starts.
"""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_table
from specrun.storage.fs import fs_of, job_path
from specrun.storage.names import id_key
from specrun.storage.schemas import TIMELINE


def timeline_path(job_root: str | os.PathLike, prompt_id: str):
    return job_path(job_root) / "timeline" / f"{id_key(prompt_id)}.parquet"


def read_timeline(path: str | os.PathLike) -> list[dict]:
    """The rows, by start offset (maps as dicts); [] when there is no file or it cannot be read."""
    path = job_path(path)
    try:
        rows = pq.read_table(fs_of(path).source(path), schema=TIMELINE).to_pylist(maps_as_pydicts="strict")
    except Exception:  # missing, truncated, not Parquet, or a flipped bit (duplicate map keys: KeyError)
        return []
    return sorted(rows, key=lambda r: (r["start"], r["attempt"]))


def chunk_row(attempt: int, start: int, end: int, seconds: float, ended_at: float, before: dict, after: dict,
              host: str, slot: int) -> dict:
    """The row for tokens [start, end): the difference of two GenStats.snapshot()s ({} = a generation's start)."""

    def diff(key: str) -> dict:
        old = before.get(key, {})
        return {k: v - old.get(k, 0) for k, v in after.get(key, {}).items() if v != old.get(k, 0)}

    return {"attempt": attempt, "start": start, "end": end, "steps": after["steps"] - before.get("steps", 0),
            "seconds": seconds, "ended_at": ended_at, "phase_seconds": diff("phase"),
            "accepted_by_drafter": diff("by_drafter"), "width_steps": diff("widths"), "host": host, "slot": slot}


class TimelineLog:
    """One prompt's timeline while a worker generates it: the earlier attempts' rows up to the resumed tokens, then
    this attempt's (numbered one past every attempt seen in the file)."""

    def __init__(self, path: str | os.PathLike, resumed: int):
        self.path = job_path(path)
        rows = read_timeline(self.path)
        self.attempt = 1 + max((r["attempt"] for r in rows), default=0)
        self.rows = rows
        self.truncate(resumed)

    def truncate(self, n_tokens: int) -> None:
        """Drop the rows of tokens past the first n_tokens (they are being generated again)."""
        self.rows = [r for r in self.rows if r["end"] <= n_tokens]

    def add(self, row: dict) -> None:
        self.rows.append(row)

    def save(self) -> None:
        """Rewrite the file (OSError when that fails: the rows stay, the next save writes them)."""
        atomic_write_table(self.path, pa.Table.from_pylist(self.rows, schema=TIMELINE))
