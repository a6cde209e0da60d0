"""Per-prompt timelines: JOB/timeline/<id key>.parquet (schemas.TIMELINE), one row per checkpoint chunk and one for the
tokens after the last chunk, so that `specrun report` sees a running, interrupted or resumed prompt as it went.

Written by the prompt's worker, rewritten whole (atomically) at each checkpoint: O(chunks) per write, beside a chunk of
checkpoint_every tokens. Not under progress/, so it outlives the chunks that finished prompts drop and compaction.
Rows of tokens that a resume regenerates (chunks set aside, or never written) are dropped when the next attempt starts.
Finished prompts' files are merged by the driver's compaction into timeline/merged.*.parquet (one row per chunk, with
its prompt id), so a finished job holds a few timeline files, not one per prompt.
"""

from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_table
from specrun.storage.fs import fs_of, job_path
from specrun.storage.names import id_key
from specrun.storage.schemas import MERGED_TIMELINE, TIMELINE

MERGED_PREFIX = "merged."
MAX_MERGED = 8  # at this many merged files the next merge folds them all into its own


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


def merge_timelines(job_root, prompt_ids: list[str], fold_merged: bool = False) -> None:
    """Move finished prompts' timelines (and with fold_merged, every merged file so far) into one new
    timeline/merged.<random>.parquet. The new file is written (atomically) before any file it holds is removed: a
    crash in between leaves rows in two places, and readers take a prompt's own file first and each (prompt,
    attempt, start) once, so no row is lost or counted twice. OSError (disk full) leaves everything as it was."""
    directory = job_path(job_root) / "timeline"
    rows, merged_paths, own_paths = [], [], []
    if fold_merged or len(_merged_names(directory)) >= MAX_MERGED:  # a bounded number of merged files at any N
        for name, merged in _merged_files(directory):
            rows.extend(merged)
            merged_paths.append(directory / name)
    for pid in prompt_ids:
        path = timeline_path(job_root, pid)
        own = read_timeline(path)
        rows.extend({"id": pid, **r} for r in own)
        if own or fs_of(path).exists(path):
            own_paths.append(path)
    if not own_paths and len(merged_paths) <= 1:
        return  # nothing to merge
    paths = merged_paths + own_paths
    if rows:
        target = directory / f"{MERGED_PREFIX}{uuid.uuid4().hex[:16]}.parquet"
        atomic_write_table(target, pa.Table.from_pylist(rows, schema=MERGED_TIMELINE))
    for path in paths:
        fs_of(path).delete(path)


def _merged_names(directory) -> list[str]:
    try:
        return sorted(n for n in fs_of(directory).list(directory)
                      if n.startswith(MERGED_PREFIX) and n.endswith(".parquet"))
    except OSError:
        return []


def _merged_files(directory) -> list[tuple[str, list[dict]]]:
    """(name, rows with their id) of every readable merged file (an unreadable one is skipped: fewer rows shown)."""
    fs = fs_of(directory)
    out = []
    for name in _merged_names(directory):
        try:
            table = pq.read_table(fs.source(directory / name), schema=MERGED_TIMELINE)
            out.append((name, table.to_pylist(maps_as_pydicts="strict")))
        except Exception:  # truncated, not Parquet, a flipped bit
            continue
    return out


def read_merged_timelines(job_root) -> dict[str, list[dict]]:
    """Prompt id -> its rows from every merged file, each (attempt, start) once."""
    out: dict[str, dict[tuple, dict]] = {}
    for _, rows in _merged_files(job_path(job_root) / "timeline"):
        for r in rows:
            out.setdefault(r.pop("id"), {}).setdefault((r["attempt"], r["start"]), r)
    return {pid: sorted(rs.values(), key=lambda r: (r["start"], r["attempt"])) for pid, rs in out.items()}


def prompt_timeline(job_root, prompt_id: str, merged: dict[str, list[dict]]) -> list[dict]:
    """A prompt's rows: its own file while it has one (running, resumed, or not merged yet), else the merged ones."""
    own = read_timeline(timeline_path(job_root, prompt_id))
    return own or merged.get(prompt_id, [])
