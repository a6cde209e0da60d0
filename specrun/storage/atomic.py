"""Atomic file writes: a file becomes visible under its final name only complete (tmp name, flush, fsync, rename).

Local paths only (a `file://` prefix is accepted); every job file goes through these helpers (I3). Temporaries are
hidden names in the target's directory, `.<name>.<8 hex>.tmp`, so that a glob of `*.parquet` never matches one.
durable=False skips the fsyncs (still atomic: a reader sees the old file or the new one, never half of one) for
files that are rebuilt from durable ones after a crash (live status, done markers).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def local_path(uri: str | os.PathLike) -> Path:
    """A job location as a local Path; refuses URIs of other filesystems with a message naming the value."""
    s = os.fspath(uri)
    if s.startswith("file://"):
        s = s[len("file://"):]
    elif "://" in s:
        raise ValueError(f"job location {s!r}: only local paths (or file://) are supported; "
                         f"mount shared storage instead")
    return Path(s)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def is_tmp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, durable: bool = True):
    """Yields a temporary path in `path`'s directory for the caller to write (e.g. a ParquetWriter); on a clean exit
    it is fsynced and renamed onto `path`, on an exception removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(path)
    try:
        yield tmp
        if durable:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> Path:
    """Write `data` to a temporary name in the same directory, fsync it, then os.replace it onto `path`."""
    with atomic_path(path, durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_json(path: str | os.PathLike, obj, durable: bool = True) -> Path:
    return atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), durable)


def table_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def atomic_write_table(path: str | os.PathLike, table: pa.Table) -> Path:
    return atomic_write_bytes(path, table_bytes(table))


def read_json(path: str | os.PathLike):
    with open(path, "rb") as f:
        return json.loads(f.read().decode("utf-8"))
