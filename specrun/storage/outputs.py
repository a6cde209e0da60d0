"""outputs/ of a job: every finished row (schemas.OUTPUT) exactly once (I4), in a few Parquet files with row groups.

Files:
  <key>.parquet                    a part: one prompt's row, written (durably) by the driver when the prompt finished
                                   (key = names.id_key(id)), before its done marker (I3)
  merged.<level>.<16 hex>.parquet  many rows in input order, in row groups, written by a compaction
Compaction (merging.py; the driver only, under the job lock, one at a time) writes a merged file completely and
durably, and only then removes the files it replaces: at every instant each row is in at least one complete file.
Parts merge into a level-1 file, FANOUT files of one level into one of the next, and when every prompt is done
everything into one.

Readers (export, status, the driver) take a snapshot: list the directory, open the merged files and read their id
columns, list again, and start over if a merged file appeared meanwhile (a compaction ran: its output is then in the
snapshot, so nothing it removed is missed). Parts are opened only when their row is read; one gone by then was
compacted away, and the read resumes on a new snapshot after the last row it gave out. Rows come out in input order,
each id once: never twice, never missed.

outputs/*.parquet is a plain Parquet dataset (pyarrow, pandas, duckdb): after a run each row is in it once; while a
compaction runs (or after a crash inside one, until the next run) a row can be in two files, so read a running job
through `specrun export` (or dedupe on id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pyarrow as pa

from specrun.storage.fs import fs_of, job_path, move_aside
from specrun.storage.names import id_key
from specrun.storage.rowfiles import Source, bad_rows, gone, merge_batches, merge_rows, open_parquet, row_writer
from specrun.storage.schemas import OUTPUT

PART = re.compile(r"^([A-Za-z0-9_-]+-[0-9a-f]{16})\.parquet$")
MERGED = re.compile(r"^merged\.(\d+)\.[0-9a-f]{16}\.parquet$")
PARTS_PER_MERGE = 256  # the driver merges parts once this many have accumulated
FANOUT = 8  # this many merged files of one level are merged into one of the next
SNAPSHOT_TRIES = 50


def order_key(order: dict[str, int]):
    """key(id) for merging by input position (ids not in `order` last, by id)."""
    n = len(order)
    return lambda pid: (order.get(pid, n), pid)


@dataclass
class Snapshot:
    sources: list[Source]
    problems: list[str] = field(default_factory=list)

    def close(self) -> None:
        for s in self.sources:
            s.close()


@dataclass
class Compaction:
    files_in: int = 0
    rows: int = 0
    merged_parts: list[str] = field(default_factory=list)  # ids whose part file was merged (and removed)
    lost: list[str] = field(default_factory=list)  # ids whose row could not be read: not done any more
    problems: list[str] = field(default_factory=list)


@dataclass
class Scan:
    rows: dict[str, dict]  # id -> the requested columns of its row, for every readable row
    in_parts: set[str]  # ids whose row is (only) in a part file
    problems: list[str]
    damaged: set[str] = field(default_factory=set)  # ids whose only rows do not match their checksum (verify)


def _checked(table: pa.Table, read: list[str] | None, cols: list[str], verify: bool, damaged: set
             ) -> list[dict]:
    """The rows of `table` (read for `read`, None: every column) as dicts of `cols`; with `verify`, those that match their checksum
    (the ids of the others go to `damaged`)."""
    if not verify:
        return table.to_pylist()
    bad = bad_rows(table, read)
    ids = table.column("id").to_pylist()
    damaged.update(ids[i] for i in bad if ids[i] is not None)
    keep = [i for i in range(table.num_rows) if i not in bad]
    return table.select(cols).take(keep).to_pylist() if bad else table.select(cols).to_pylist()


FOREIGN = "holds rows that are not this job's"
STAMP = b"specrun.job"  # Parquet metadata key: the identity of the job that wrote the file


def foreign(path) -> str:
    return (f"{path.name} {FOREIGN} (copied in from another job?): left alone, never read, merged or exported; "
            f"move it out of {path.parent}")


def is_foreign(problem: str) -> bool:
    """Whether a snapshot problem is a foreign file (nothing of the job's was lost), not an unreadable one."""
    return FOREIGN in problem


class OutputStore:
    def __init__(self, directory, job_keys=None, job_stamp=None):
        self.dir = job_path(directory)
        self.fs = fs_of(self.dir)
        # () -> the file keys of the job's prompts: a file holding any other row is foreign (copied in from elsewhere)
        # and is never read, merged, moved or deleted; None (a bare store): every file is the job's
        self.job_keys = job_keys
        # () -> the job's identity (its manifest's checksum), written into every file's metadata: a file stamped
        # with another is foreign too, even where its ids are the job's; files written before stamps have none
        self.job_stamp = job_stamp

    def schema(self) -> pa.Schema:
        """The schema files are written with: OUTPUT, stamped with the job's identity when it has one."""
        stamp = self.job_stamp() if self.job_stamp is not None else None
        return OUTPUT.with_metadata({STAMP: stamp.encode()}) if stamp else OUTPUT

    def _other_job(self, pf, stamp: bytes | None) -> bool:
        """Whether an open file carries another job's stamp."""
        mine = (pf.schema_arrow.metadata or {}).get(STAMP)
        return stamp is not None and mine is not None and mine != stamp

    def part_path(self, prompt_id: str):
        return self.dir / f"{id_key(prompt_id)}.parquet"

    def write_part(self, row: dict):
        """One prompt's row, durable when this returns; a rerun replaces the same file (never a second row)."""
        path = self.part_path(row["id"])
        with row_writer(path, self.schema()) as w:
            w.add(pa.Table.from_pylist([row], schema=OUTPUT))
        return path

    def _list(self) -> tuple[dict, list[tuple[int, object]]]:
        parts, merged = {}, []
        for n in self.fs.list(self.dir):
            if m := PART.match(n):
                parts[m.group(1)] = self.dir / n
            elif m := MERGED.match(n):
                merged.append((int(m.group(1)), self.dir / n))
        return parts, sorted(merged)

    def _part_of_other_job(self, path, stamp: bytes) -> bool:
        try:
            with open_parquet(path) as pf:  # the footer only
                return self._other_job(pf, stamp)
        except Exception:  # noqa: BLE001 - unreadable: reading its row says so (and repair sets it aside)
            return False

    def snapshot(self, keymap: dict[str, str], set_aside: bool = False) -> Snapshot:
        """The files of outputs/ as of one consistent moment (see the module doc). keymap: file key -> prompt id (a
        part whose key is not in it is opened to read its id). set_aside: move unreadable merged files to .corrupt."""
        keys = self.job_keys() if self.job_keys is not None else None
        stamp = self.job_stamp() if self.job_stamp is not None else None
        stamp = stamp.encode() if stamp else None
        for _ in range(SNAPSHOT_TRIES):
            parts, merged = self._list()
            snap, complete = Snapshot([]), True
            for level, path in merged:
                try:
                    pf = open_parquet(path)
                    ids = pf.read(columns=["id"]).column(0).to_pylist()
                except FileNotFoundError:
                    complete = False
                    break
                except Exception as e:  # truncated, not Parquet, checksum: its rows are not done
                    if gone(path):  # removed by a compaction while open (object stores)
                        complete = False
                        break
                    snap.problems.append(f"{path.name} is unreadable ({type(e).__name__}: {str(e)[:200]})")
                    if set_aside:
                        move_aside(path)
                    continue
                if keys is not None and any(id_key(i) not in keys for i in ids) or self._other_job(pf, stamp):
                    pf.close()
                    snap.problems.append(foreign(path))
                    continue
                snap.sources.append(Source(path, ids, pf, level))
            if complete:
                complete = not {p for _, p in self._list()[1]} - {p for _, p in merged}
            if not complete:
                snap.close()
                continue
            for key, path in parts.items():
                if keys is not None and key not in keys or stamp is not None and self._part_of_other_job(path, stamp):
                    snap.problems.append(foreign(path))
                    continue
                pid = keymap.get(key)
                if pid is None:
                    try:
                        with open_parquet(path) as pf:
                            pid = pf.read(columns=["id"]).column(0)[0].as_py()
                    except Exception as e:
                        snap.problems.append(f"{path.name} is unreadable ({type(e).__name__}: {str(e)[:200]})")
                        if set_aside:
                            move_aside(path)
                        continue
                snap.sources.append(Source(path, [pid]))
            return snap
        raise OSError(f"{self.dir} kept changing during {SNAPSHOT_TRIES} attempts to read it")

    def rows(self, keymap: dict[str, str], key, columns=None, problems: list | None = None, batches: bool = False):
        """Yields (id, 1-row table) for every readable row, in key order, each id once; unreadable rows are skipped
        and described in `problems`. With `batches`, (ids, table) of rows that follow each other in one row group.
        Memory: the id columns, plus a row group per file being read."""
        last = None
        merge = merge_batches if batches else merge_rows
        for _ in range(SNAPSHOT_TRIES):
            snap = self.snapshot(keymap)
            try:
                for k, pid, t in merge(snap.sources, key, columns, after=last):
                    last = k
                    yield pid, t
            except FileNotFoundError:  # a part was compacted away: its row is in a newer merged file
                continue
            finally:
                snap.close()
            if problems is not None:
                problems.extend(snap.problems)
                problems.extend(f"{s.path.name}: {b}" for s in snap.sources for b in s.bad)
            return
        raise OSError(f"{self.dir} kept changing during {SNAPSHOT_TRIES} attempts to read it")

    def scan(self, keymap: dict[str, str], columns=("id", "n_tokens"), verify: bool = False) -> Scan:
        """Small columns of every readable row (not token_ids or text unless asked): cheap for status and the
        driver. A file is readable here when its footer and these columns are. With `verify` (status), every column
        is read and checked as export reads and checks it (one row group at a time): a row that does not match its
        checksum, or whose file's columns are not OUTPUT's, is not found, and its id is in Scan.damaged."""
        cols = list(dict.fromkeys(["id", *columns]))
        read = None if verify else cols
        for _ in range(SNAPSHOT_TRIES):
            snap = self.snapshot(keymap)
            found, in_parts, damaged = {}, set(), set()
            try:
                for src in sorted(snap.sources, key=lambda s: -s.level):  # merged first
                    try:
                        if src.pf is not None:
                            tables = (src.pf.read_row_group(g, columns=read)
                                      for g in range(src.pf.metadata.num_row_groups))
                            rows = [r for t in tables for r in _checked(t, read, cols, verify, damaged)]
                        else:
                            with open_parquet(src.path) as pf:
                                t = pf.read(columns=read)
                            if t.num_rows != 1 or t.column("id")[0].as_py() != src.ids[0]:
                                raise ValueError("it does not hold the row its name says")
                            rows = _checked(t, read, cols, verify, damaged)
                    except FileNotFoundError:
                        raise
                    except Exception as e:
                        if gone(src.path):  # removed by a compaction while open (object stores)
                            raise FileNotFoundError(str(src.path)) from e
                        snap.problems.append(f"{src.path.name} is unreadable ({type(e).__name__}: {str(e)[:200]})")
                        continue
                    for r in rows:
                        if r["id"] not in found:
                            found[r["id"]] = r
                            if src.level == 0:
                                in_parts.add(r["id"])
            except FileNotFoundError:
                continue
            finally:
                snap.close()
            return Scan(found, in_parts, snap.problems, damaged - set(found))
        raise OSError(f"{self.dir} kept changing during {SNAPSHOT_TRIES} attempts to read it")
