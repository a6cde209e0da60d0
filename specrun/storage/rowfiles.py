"""Streaming reads and writes of row files (Parquet files of output rows), in memory bounded by row groups: never by
the number of rows, nor by how many files hold them.

- row_writer(path, schema): rows in (Arrow tables of any length), one Parquet file out, atomically (temporary name,
  fsync, rename: I3). A row group is cut every ROW_GROUP_BYTES of Arrow data or ROW_GROUP_ROWS rows; zstd; every
  page carries a CRC that open_parquet() verifies on read, so a flipped bit is an error, never a wrong token.
- merge_rows(sources, key): the rows of several files in key order, each key once. A Source is one file whose ids
  are known up front (from its id column, or from its name); its rows are split into runs of nondecreasing key (a
  file we write is a single run) and the runs are merged with a heap. Each run holds at most one decoded row group.
  A source whose file is gone (opened lazily, or, on an object store, removed while open) raises FileNotFoundError:
  the caller takes a new snapshot and resumes after the last key it got (`after`). key(id) orders ids; equal ids must
  have equal keys (the merge gives out one row per key).
"""

from __future__ import annotations

import contextlib
import heapq
import os
from bisect import bisect_right
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_path
from specrun.storage.fs import fs_of, job_path

ROW_GROUP_BYTES = 16 << 20  # decoded Arrow bytes: what a reader holds per file it merges
ROW_GROUP_ROWS = 65536
WRITE_OPTIONS = dict(compression="zstd", write_page_checksum=True)


def open_parquet(path: str | os.PathLike) -> pq.ParquetFile:
    """A Parquet file whose page checksums are verified as it is read."""
    path = job_path(path)
    return pq.ParquetFile(fs_of(path).source(path), page_checksum_verification=True)


def gone(path) -> bool:
    """After a read error: whether the file was removed (a compaction ran: read a new snapshot), not damaged."""
    return not fs_of(path).exists(path)


class RowWriter:
    def __init__(self, writer: pq.ParquetWriter, group_bytes: int, group_rows: int):
        self._w, self._group_bytes, self._group_rows = writer, group_bytes, group_rows
        self._buf: list[pa.Table] = []
        self._bytes = self._rows = 0
        self.rows = 0

    def add(self, table: pa.Table) -> None:
        """Rows to write; a row group is cut at group_rows rows, or once it holds group_bytes (by whole rows)."""
        while table.num_rows:
            head = table.slice(0, self._group_rows - self._rows)
            table = table.slice(head.num_rows)
            self._buf.append(head)
            self._bytes += head.nbytes
            self._rows += head.num_rows
            self.rows += head.num_rows
            if self._bytes >= self._group_bytes or self._rows >= self._group_rows:
                self.flush()

    def flush(self) -> None:
        if self._buf:
            t = pa.concat_tables(self._buf)
            self._w.write_table(t, row_group_size=max(1, t.num_rows))
            self._buf, self._bytes, self._rows = [], 0, 0


@contextlib.contextmanager
def row_writer(path: str | os.PathLike, schema: pa.Schema, *, durable: bool = True, group_bytes: int | None = None,
               group_rows: int | None = None):
    """Context manager yielding a RowWriter; the file appears at `path` only complete, on a clean exit."""
    with atomic_path(path, durable) as tmp:
        pw = pq.ParquetWriter(tmp, schema, **WRITE_OPTIONS)
        w = RowWriter(pw, group_bytes or ROW_GROUP_BYTES, group_rows or ROW_GROUP_ROWS)
        try:
            yield w
            w.flush()
        finally:
            pw.close()


@dataclass(eq=False)
class Source:
    """One row file in a snapshot. `pf` is open (pinned: on POSIX a file removed after it was opened stays readable; on
    an object store it does not, see gone()) when the ids were read from the file; None when they come from its name
    (opened when its row is needed)."""
    path: object  # a Path or an ObjectPath
    ids: list[str]
    pf: pq.ParquetFile | None = None
    level: int = 0  # 0: one prompt's part file; >= 1: a merged file
    bad: list[str] = field(default_factory=list)  # what could not be read from it

    def close(self) -> None:
        if self.pf is not None:
            self.pf.close()
            self.pf = None


class _Run:
    """Rows [start, end) of one source, in key order; reads its row groups one at a time, in order."""

    def __init__(self, src: Source, start: int, end: int, columns):
        self.src, self.start, self.end, self.columns = src, start, end, columns
        self.group = -1
        self.table: pa.Table | None = None
        if src.pf is not None:
            md = src.pf.metadata
            self.offsets = [0]
            for i in range(md.num_row_groups):
                self.offsets.append(self.offsets[-1] + md.row_group(i).num_rows)

    def fetch(self, pos: int) -> tuple[int, pa.Table, int] | None:
        """(row group number, that row group, index of `pos` in it); None (noted in src.bad) when unreadable."""
        src = self.src
        if src.pf is None:  # a part file: open, read its one row, close
            try:
                with open_parquet(src.path) as pf:
                    t = pf.read(columns=self.columns)
            except FileNotFoundError:
                raise
            except Exception as e:  # truncated, not Parquet, checksum
                if gone(src.path):
                    raise FileNotFoundError(str(src.path)) from e
                src.bad.append(f"{type(e).__name__}: {str(e)[:200]}")
                return None
            if t.num_rows != 1 or ("id" in t.column_names and t.column("id")[0].as_py() != src.ids[0]):
                src.bad.append("does not hold the row its name says")
                return None
            return 0, t, 0
        g = bisect_right(self.offsets, pos) - 1
        if g != self.group:
            self.group = g
            try:
                self.table = src.pf.read_row_group(g, columns=self.columns)
            except Exception as e:  # a page checksum or decoding error: this row group's rows are lost
                if gone(src.path):
                    raise FileNotFoundError(str(src.path)) from e
                src.bad.append(f"row group {g}: {type(e).__name__}: {str(e)[:200]}")
                self.table = None
        return None if self.table is None else (g, self.table, pos - self.offsets[g])


def _runs(src: Source, key, columns) -> list[_Run]:
    out, start, prev = [], 0, None
    for i, rid in enumerate(src.ids):
        k = key(rid)
        if prev is not None and k < prev:
            out.append(_Run(src, start, i, columns))
            start = i
        prev = k
    if src.ids:
        out.append(_Run(src, start, len(src.ids), columns))
    return out


def _merge(sources: list[Source], key, columns, after, cancel):
    """(key, id, run number, row group number, row group table, index in it) of every readable row, in key order,
    each key once."""
    runs = [r for s in sources for r in _runs(s, key, columns)]

    def keys(i: int, run: _Run):
        for pos in range(run.start, run.end):
            yield key(run.src.ids[pos]), i, pos
        run.table = None  # resumed only after its last row was read: done with its row group

    last = after
    for k, i, pos in heapq.merge(*(keys(i, r) for i, r in enumerate(runs))):
        if cancel is not None and cancel.is_set():
            raise InterruptedError("cancelled")
        if last is not None and k <= last:
            continue
        got = runs[i].fetch(pos)
        if got is not None:
            last = k
            yield (k, runs[i].src.ids[pos], i, *got)


def merge_rows(sources: list[Source], key, columns=None, after=None, cancel=None):
    """Yields (key, id, 1-row table) for every readable row of `sources` with key > `after`, in key order, each key
    once (a copy that cannot be read gives way to another copy of the same key). Unreadable rows are skipped and
    noted in their source's `bad`. `cancel` (a threading.Event) stops it with InterruptedError."""
    for k, pid, _, _, table, j in _merge(sources, key, columns, after, cancel):
        yield k, pid, table.slice(j, 1)


def merge_batches(sources: list[Source], key, columns=None, after=None, cancel=None):
    """As merge_rows, but rows that follow each other in one row group of one file come out as one slice: yields
    (last key, ids, table). For writers: a slice per row would cost far more than the row itself."""
    cur = None  # [run, group, table, first index, ids, last key]
    for k, pid, run, g, table, j in _merge(sources, key, columns, after, cancel):
        if cur is not None and cur[0] == run and cur[1] == g and cur[3] + len(cur[4]) == j:
            cur[4].append(pid)
            cur[5] = k
            continue
        if cur is not None:
            yield cur[5], cur[4], cur[2].slice(cur[3], len(cur[4]))
        cur = [run, g, table, j, [pid], k]
    if cur is not None:
        yield cur[5], cur[4], cur[2].slice(cur[3], len(cur[4]))
