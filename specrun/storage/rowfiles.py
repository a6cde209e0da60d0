"""Streaming reads and writes of row files (Parquet files of output rows), in memory bounded by row groups: never by
the number of rows, nor by how many files hold them.

- row_writer(path, schema): rows in (Arrow tables of any length), one Parquet file out, atomically (temporary name,
  fsync, rename: I3). A row group is cut every ROW_GROUP_BYTES of Arrow data or ROW_GROUP_ROWS rows; zstd; every
  page carries a CRC that open_parquet() verifies on read. Page headers have none (a flipped bit there can drop or
  shift values unseen), so each output row also carries a checksum of what it says (id, token_ids, text,
  finish_reason: row_checksum); a row that does not match it is unreadable, never a wrong token.
- merge_rows(sources, key): the rows of several files in key order, each key once. A Source is one file whose ids
  are known up front (from its id column, or from its name); its rows are split into runs of nondecreasing key (a
  file we write is a single run) and the runs are merged with a heap. Each run holds at most one decoded row group.
  A source whose file is gone (opened lazily, or, on an object store, removed while open) raises FileNotFoundError:
  the caller takes a new snapshot and resumes after the last key it got (`after`). key(id) orders ids; equal ids must
  have equal keys (the merge gives out one row per key).
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import os
from bisect import bisect_right
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specrun.storage.atomic import atomic_path
from specrun.storage.fs import fs_of, job_path
from specrun.storage.schemas import OUTPUT

ROW_GROUP_BYTES = 16 << 20  # decoded Arrow bytes: what a reader holds per file it merges
ROW_GROUP_ROWS = 65536
WRITE_OPTIONS = dict(compression="zstd", write_page_checksum=True)


def open_parquet(path: str | os.PathLike) -> pq.ParquetFile:
    """A Parquet file whose page checksums are verified as it is read."""
    path = job_path(path)
    return pq.ParquetFile(fs_of(path).source(path), page_checksum_verification=True)


def row_checksum(prompt_id: str, token_ids, text: str, finish_reason: str) -> str:
    """sha256 of an output row's content (token ids as little-endian int32), for its "checksum" column."""
    h = hashlib.sha256()
    for part in (prompt_id.encode(), np.asarray(token_ids, dtype="<i4").tobytes(), text.encode(),
                 finish_reason.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def bad_rows(table: pa.Table, columns=None) -> set[int]:
    """Rows of an output table read for `columns` (None: all) that do not match their checksum; all of them when its
    columns are not those asked for, with OUTPUT's types (a flipped bit in the footer renamed or retyped one). Rows
    read without the checksummed columns, or written before checksums, are checked for their columns only."""
    want = list(columns) if columns is not None else OUTPUT.names
    names = table.schema.names
    if names not in (want, [n for n in want if n != "checksum"]) or any(
            n not in OUTPUT.names or OUTPUT.field(n).type != table.schema.field(n).type for n in names):
        return set(range(table.num_rows))
    names = ("id", "token_ids", "text", "finish_reason", "checksum")
    if not set(names) <= set(table.column_names):
        return set()
    ids, toks, texts, reasons, sums = (table.column(n) for n in names)
    bad = set()
    for i in range(table.num_rows):
        want = sums[i].as_py()
        try:
            ok = want is None or want == row_checksum(ids[i].as_py(), toks[i].values.to_numpy(zero_copy_only=False),
                                                      texts[i].as_py(), reasons[i].as_py())
        except (TypeError, ValueError, AttributeError, pa.ArrowException):  # nulls where a flipped bit put them
            ok = False
        if not ok:
            bad.add(i)
    return bad


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` with `schema`'s columns, in its order: a column added since the file was written is null."""
    if table.schema.names == schema.names:
        return table
    cols = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


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
        table = conform(table, self._w.schema)  # rows of files written before a column was added
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
               group_rows: int | None = None, atomic: bool = True):
    """Context manager yielding a RowWriter; the file appears at `path` only complete, on a clean exit (atomic=False:
    written in place, for a path that is not a regular file, such as a pipe)."""
    with atomic_path(path, durable) if atomic else open(path, "wb") as tmp:  # a pipe: a stream, no seeks
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
        self.bad: set[int] = set()  # rows of self.table that do not match their checksum
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
            if bad_rows(t, self.columns):
                src.bad.append("its row does not match its checksum")
                return None
            return 0, t, 0
        g = bisect_right(self.offsets, pos) - 1
        if g != self.group:
            self.group = g
            try:
                self.table = src.pf.read_row_group(g, columns=self.columns)
                self.bad = bad_rows(self.table, self.columns)
            except Exception as e:  # a page checksum or decoding error: this row group's rows are lost
                if gone(src.path):
                    raise FileNotFoundError(str(src.path)) from e
                src.bad.append(f"row group {g}: {type(e).__name__}: {str(e)[:200]}")
                self.table = None
        if self.table is None:
            return None
        if pos - self.offsets[g] in self.bad:
            src.bad.append(f"row {pos} does not match its checksum")
            return None
        return g, self.table, pos - self.offsets[g]


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
