"""Atomic file writes: a file becomes visible under its final name only complete (I3), on the JobFS of its location
(storage/fs.py: local temp-write-fsync-rename, object-store PUT); every job file goes through these helpers.

durable=False skips the fsyncs of a local write (still atomic: a reader sees the old file or the new one, never half
of one) for files that are rebuilt from durable ones after a crash (live status, done markers).
"""

from __future__ import annotations

import io
import json
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.fs import fs_of, job_path


def atomic_path(path: str | os.PathLike, durable: bool = True):
    """Context manager yielding a local temporary path for the caller to write (e.g. a ParquetWriter); on a clean exit
    it becomes the file at `path` (a job location: a Path, an ObjectPath or a URI), on an exception it is removed."""
    path = job_path(path)
    return fs_of(path).writing(path, durable)


def output_target(path: str | os.PathLike):
    """Where a user's output file (`export -o`, `report -o`) goes: (its location, whether to write it atomically). A
    local symlink is followed (its target is written, the link stays); an existing file that is not a regular one
    (a device such as /dev/null or /dev/stdout, a FIFO) is written in place, never replaced by a rename."""
    path = job_path(path)
    if not isinstance(path, Path):
        return path, True
    try:
        mode = os.stat(path).st_mode  # through links, /proc's pipe links included
    except FileNotFoundError:
        return Path(os.path.realpath(path)), True  # a new file, or the target a dangling link names
    return (Path(os.path.realpath(path)), True) if stat.S_ISREG(mode) else (path, False)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True):
    """Write `data` as the file at `path`, atomically; returns the location."""
    path = job_path(path)
    fs_of(path).put(path, data, durable)
    return path


def atomic_write_json(path: str | os.PathLike, obj, durable: bool = True):
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), durable)


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def atomic_write_table(path: str | os.PathLike, table: pa.Table):
    return atomic_write_bytes(path, table_bytes(table))


def read_json(path: str | os.PathLike):
    path = job_path(path)
    return json.loads(fs_of(path).read(path).decode("utf-8"))
