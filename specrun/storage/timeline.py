"""Per-prompt timelines: JOB/timeline/<id key>.parquet (schemas.TIMELINE), one row per checkpoint chunk and one for the
tokens after the last chunk, so that `specrun report` sees a running, interrupted or resumed prompt as it went.

Written by the prompt's worker, rewritten whole (atomically) at each checkpoint: O(chunks) per write, beside a chunk of
checkpoint_every tokens. Not under progress/, so it outlives the chunks that finished prompts drop and compaction.
Rows of tokens that a resume regenerates (chunks set aside, or never written) are dropped when the next attempt starts.
Finished prompts' files are merged by the driver's compaction into timeline/merged.<generation>.<hex>.parquet
(schemas.MERGED_TIMELINE: the rows with their prompt id), so a running job holds a few merged files, a finished one one.
"""

from __future__ import annotations

import os
import re
import uuid

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_table
from specrun.storage.fs import fs_of, job_path
from specrun.storage.names import id_key
from specrun.storage.schemas import MERGED_TIMELINE, TIMELINE

MERGED = re.compile(r"^merged\.(\d+)\.[0-9a-f]{16}\.parquet$")  # merged.<generation>.<16 hex>.parquet
MAX_MERGED = 8  # at this many merged files the next merge folds them all into its own
READ_TRIES = 50


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
              host: str, slot: int, rss_mb: float | None = None) -> dict:
    """The row for tokens [start, end): the difference of two GenStats.snapshot()s ({} = a generation's start);
    rss_mb: the worker's resident memory now."""

    def diff(key: str) -> dict:
        old = before.get(key, {})
        return {k: v - old.get(k, 0) for k, v in after.get(key, {}).items() if v != old.get(k, 0)}

    return {"attempt": attempt, "start": start, "end": end, "steps": after["steps"] - before.get("steps", 0),
            "seconds": seconds, "ended_at": ended_at, "phase_seconds": diff("phase"),
            "accepted_by_drafter": diff("by_drafter"), "width_steps": diff("widths"), "host": host, "slot": slot,
            "nodes": after.get("nodes", 0) - before.get("nodes", 0), "rss_mb": rss_mb}


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


def merge_timelines(job_root, prompt_ids, fold: bool = False) -> None:
    """Move the own files of finished `prompt_ids` (those that have one) into one new merged file of the next
    generation, and with `fold` (the job is done) or at MAX_MERGED merged files, every merged file too. The driver's
    compaction only, under the job lock. The new file is written (atomically) before any file it holds is removed: a
    crash in between leaves rows in two places, and readers take a prompt's own file first, else its rows in the newest
    merged file that holds it, so no row is lost or shown twice. OSError (disk full) leaves everything as it was."""
    directory = job_path(job_root) / "timeline"
    fs = fs_of(directory)
    names = set(fs.list(directory))
    merged = _merged(names)
    own = [pid for pid in dict.fromkeys(prompt_ids) if timeline_path(job_root, pid).name in names]
    fold = fold or len(merged) >= MAX_MERGED  # a bounded number of merged files whatever the number of prompts
    if not own and not (fold and len(merged) > 1):
        return
    own_rows = [{"id": pid, **r} for pid in own for r in read_timeline(timeline_path(job_root, pid))]
    tables, folded = [pa.Table.from_pylist(own_rows, schema=MERGED_TIMELINE)], []
    if fold:  # in Arrow, not Python rows: a 10,000-prompt job's timelines are ~100 MB there, ~1 GB as dicts
        taken = set(own)  # a prompt's rows: its own file's (its latest run), else the newest merged file's
        for _, name in reversed(merged):
            try:
                table = _read_merged_table(directory / name)
            except ValueError:  # damaged: its rows are lost, and it must not count towards the next fold
                fs.rename(directory / name, directory / f"{name}.corrupt")
                continue
            table = table.filter(pc.invert(pc.is_in(table.column("id"), value_set=pa.array(list(taken), pa.string()))))
            taken.update(pc.unique(table.column("id")).to_pylist())
            tables.append(table)
            folded.append(directory / name)
    table = pa.concat_tables(tables)
    if table.num_rows:
        generation = 1 + max((g for g, _ in merged), default=0)
        atomic_write_table(directory / f"merged.{generation}.{uuid.uuid4().hex[:16]}.parquet", table)
    for path in folded + [timeline_path(job_root, pid) for pid in own]:
        fs.delete(path)


def read_timelines(job_root, prompt_ids) -> dict[str, list[dict]]:
    """Prompt id -> its rows by start offset (prompts without any left out): its own file while it has one (running,
    interrupted, or finished and not merged yet), else the newest merged file that holds it. Own files are read
    before the merged ones, which are listed again when one vanished (a fold): a compaction writes its file before it
    removes what the file holds, so one running meanwhile hides no row."""
    directory = job_path(job_root) / "timeline"
    names = set(fs_of(directory).list(directory))
    out = {}
    for pid in prompt_ids:
        path = timeline_path(job_root, pid)
        if path.name in names and (rows := read_timeline(path)):
            out[pid] = rows
    merged = read_merged_timelines(job_root)
    return out | {pid: merged[pid] for pid in prompt_ids if pid not in out and pid in merged}


def read_merged_timelines(job_root) -> dict[str, list[dict]]:
    """Prompt id -> its rows in the newest merged file that holds it (a damaged merged file is skipped)."""
    directory = job_path(job_root) / "timeline"
    fs = fs_of(directory)
    for _ in range(READ_TRIES):
        out: dict[str, list[dict]] = {}
        for _, name in _merged(fs.list(directory)):  # oldest first: newer generations replace a prompt's rows
            try:
                out.update(_read_merged(directory / name))
            except FileNotFoundError:  # folded into a newer file meanwhile: list again
                break
            except ValueError:
                continue
        else:
            return out
    raise OSError(f"{directory} kept changing during {READ_TRIES} attempts to read it")


def _merged(names) -> list[tuple[int, str]]:
    """(generation, name) of the merged files among `names`, oldest first."""
    return sorted((int(m.group(1)), n) for n in names if (m := MERGED.match(n)))


def _read_merged_table(path) -> pa.Table:
    """The file's rows, checked in full; FileNotFoundError when it is gone, ValueError when it is damaged."""
    fs = fs_of(path)
    try:
        table = pq.read_table(fs.source(path), schema=MERGED_TIMELINE)
        table.validate(full=True)  # offsets, UTF-8: what would make it fail later, once folded with good rows
    except Exception as e:  # missing, truncated, not Parquet, a flipped bit
        if not fs.exists(path):
            raise FileNotFoundError(str(path)) from e
        raise ValueError(f"{path.name}: {type(e).__name__}: {e}") from e
    return table


def _read_merged(path) -> dict[str, list[dict]]:
    """Prompt id -> its rows by start offset (see _read_merged_table); a map key that a flipped bit doubled keeps one
    value ("lossy"), so that one damaged row never hides the whole file."""
    out: dict[str, list[dict]] = {}
    for r in _read_merged_table(path).to_pylist(maps_as_pydicts="lossy"):
        out.setdefault(r.pop("id"), []).append(r)
    return {pid: sorted(rs, key=lambda r: (r["start"], r["attempt"])) for pid, rs in out.items()}
