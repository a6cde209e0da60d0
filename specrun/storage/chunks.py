"""Progress chunks: PROGRESS_DIR/chunk-<start:010d>-<end:010d>.parquet, one row of generated token ids.

Each chunk carries its offsets and a checksum. Reading returns the longest contiguous prefix of valid chunks that
agree with each other; everything else is moved aside so the tokens it held are regenerated, never stitched in:
corrupt or truncated chunks become `*.corrupt`, valid chunks that do not continue that prefix (after a gap, or
disagreeing with it at an overlapping or repeated span: an earlier, diverged run) become `*.stale`. A write replaces
a chunk already at the same span atomically (a stale one must never block the new one).
"""

from __future__ import annotations

import hashlib
import os
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_table
from specrun.storage.fs import fs_of, job_path, move_aside
from specrun.storage.schemas import CHUNK

_NAME = re.compile(r"^chunk-(\d{10})-(\d{10})\.parquet$")
_TMP = re.compile(r"^\.chunk-\d{10}-\d{10}\.parquet\.[0-9a-f]+\.tmp$")  # a writer killed mid-write (atomic.py)


def checksum(start: int, end: int, token_ids) -> str:
    h = hashlib.sha256(f"{start}:{end}:".encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chunk_name(start: int, end: int) -> str:
    return f"chunk-{start:010d}-{end:010d}.parquet"


def write_chunk(progress_dir: str | os.PathLike, start: int, token_ids: list[int]):
    """Write the generated tokens [start, start+len) as a chunk file; one already at that span is replaced atomically
    (it can only be a leftover of an earlier run whose later chunks read_progress has already moved aside)."""
    if not token_ids:
        raise ValueError("a chunk needs at least one token")
    end = start + len(token_ids)
    row = {"start": [start], "end": [end], "token_ids": [list(token_ids)],
           "checksum": [checksum(start, end, token_ids)], "written_at": [time.time()]}
    return atomic_write_table(job_path(progress_dir) / chunk_name(start, end), pa.Table.from_pydict(row, schema=CHUNK))


def _read_valid(path, start: int, end: int) -> list[int] | None:
    try:
        t = pq.read_table(fs_of(path).source(path), schema=CHUNK)
        if t.num_rows != 1:
            return None
        row = t.to_pylist()[0]
        toks = row["token_ids"]
        ok = (row["start"] == start and row["end"] == end and len(toks) == end - start
              and row["checksum"] == checksum(start, end, toks))
    except Exception:  # truncated, not Parquet, wrong schema, or nulls where a flipped bit put them
        return None
    return toks if ok else None


def read_progress(progress_dir: str | os.PathLike, quarantine: bool = True) -> list[int]:
    """Longest contiguous run of consistent checkpointed tokens from offset 0.

    With quarantine (the driver, before it hands the prompt to a worker: nobody writes this directory then), every
    chunk that is not part of that run is moved aside (`.corrupt` unreadable, `.stale` valid but after a gap or
    disagreeing with the run) and leftover temporaries are removed, so later chunks only ever continue the run.
    quarantine=False reads without touching anything.
    """
    d = job_path(progress_dir)
    fs = fs_of(d)
    spans = []
    for name in fs.list(d):
        m = _NAME.match(name)
        if m:
            spans.append((int(m.group(1)), int(m.group(2)), d / name))
        elif quarantine and _TMP.match(name):
            fs.delete(d / name)
    spans.sort(key=lambda s: (s[0], s[1]))
    out: list[int] = []
    for start, end, path in spans:
        if start > len(out) or end <= start:  # a gap: the tokens before it were lost, what follows is another run's
            if quarantine:
                move_aside(path, ".stale")
            continue
        toks = _read_valid(path, start, end)
        if toks is None:
            if quarantine:
                move_aside(path, ".corrupt")
            continue
        overlap = min(end, len(out)) - start
        if toks[:overlap] != out[start:start + overlap]:  # another run's tokens for the same span
            if quarantine:
                move_aside(path, ".stale")
            continue
        out.extend(toks[overlap:])
    return out


def progress_count(progress_dir: str | os.PathLike) -> int:
    """Checkpointed token count from file names only (cheap, for status; does not validate)."""
    d = job_path(progress_dir)
    n = 0
    for start, end in sorted((int(m.group(1)), int(m.group(2))) for m in map(_NAME.match, fs_of(d).list(d)) if m):
        if start <= n < end:
            n = end
    return n
