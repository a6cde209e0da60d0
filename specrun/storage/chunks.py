"""Append-only progress chunks: PROGRESS_DIR/chunk-<start:010d>-<end:010d>.parquet, one row of generated token ids.

Each chunk carries its offsets and a checksum; reading returns the longest contiguous prefix of valid chunks and
moves corrupt or truncated ones aside (`.corrupt`) so the tokens they held are regenerated.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_write_table
from specrun.storage.schemas import CHUNK

_NAME = re.compile(r"^chunk-(\d{10})-(\d{10})\.parquet$")


def checksum(start: int, end: int, token_ids) -> str:
    h = hashlib.sha256(f"{start}:{end}:".encode())
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return h.hexdigest()


def chunk_name(start: int, end: int) -> str:
    return f"chunk-{start:010d}-{end:010d}.parquet"


def write_chunk(progress_dir: str | os.PathLike, start: int, token_ids: list[int]) -> Path:
    """Append the generated tokens [start, start+len) as a new chunk file (never rewrites an existing one)."""
    if not token_ids:
        raise ValueError("a chunk needs at least one token")
    end = start + len(token_ids)
    row = {"start": [start], "end": [end], "token_ids": [list(token_ids)],
           "checksum": [checksum(start, end, token_ids)], "written_at": [time.time()]}
    path = Path(progress_dir) / chunk_name(start, end)
    if path.exists():  # same span already durable: by determinism it holds the same tokens
        return path
    return atomic_write_table(path, pa.Table.from_pydict(row, schema=CHUNK))


def _read_valid(path: Path, start: int, end: int) -> list[int] | None:
    try:
        t = pq.read_table(path, schema=CHUNK)
        if t.num_rows != 1:
            return None
        row = t.to_pylist()[0]
    except Exception:  # truncated, not Parquet, wrong schema
        return None
    toks = row["token_ids"]
    if row["start"] != start or row["end"] != end or len(toks) != end - start:
        return None
    return toks if row["checksum"] == checksum(start, end, toks) else None


def read_progress(progress_dir: str | os.PathLike, quarantine: bool = True) -> list[int]:
    """Longest contiguous run of checkpointed tokens from offset 0; invalid chunks are renamed to *.corrupt."""
    d = Path(progress_dir)
    if not d.is_dir():
        return []
    spans = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            spans.append((int(m.group(1)), int(m.group(2)), p))
    spans.sort()
    out: list[int] = []
    for start, end, path in spans:
        if start > len(out) or end <= len(out):
            continue  # a gap (tokens before it were lost) or nothing new
        toks = _read_valid(path, start, end)
        if toks is None:
            if quarantine:
                os.replace(path, path.with_name(path.name + ".corrupt"))
            continue
        out.extend(toks[len(out) - start:])
    return out


def progress_count(progress_dir: str | os.PathLike) -> int:
    """Checkpointed token count from file names only (cheap, for status; does not validate)."""
    d = Path(progress_dir)
    if not d.is_dir():
        return 0
    n = 0
    for start, end in sorted((int(m.group(1)), int(m.group(2))) for m in map(_NAME.match, os.listdir(d)) if m):
        if start <= n < end:
            n = end
    return n
