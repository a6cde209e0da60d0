"""Output store: parts compacted into merged files with row groups, in input order, exactly once (I4) even while a
compaction runs or after a crash inside one; damaged files set aside; readable by pyarrow, pandas and duckdb."""

from __future__ import annotations

import os
import random
import threading

import pyarrow.parquet as pq
import pytest

import specrun.storage.rowfiles as rowfiles
from specrun.storage.merging import compact
from specrun.storage.outputs import MERGED, PART
from specrun.storage.records import Records, output_row
from tests.storage.test_storage import flip_last_page


def _row(pid: str, n: int = 4):
    return output_row(pid, [sum(map(ord, pid)) % 97 + i for i in range(n)], f"text of {pid}", "length", {"steps": 1},
                      prompt_tokens=2, resumed_tokens=0, attempts=1)


def _files(rec: Records) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(rec.outputs))
    return [n for n in names if PART.match(n)], [n for n in names if MERGED.match(n)]


def _ids(rec, ids):
    got = [i for i, _ in rec.iter_outputs(ids)]
    assert len(got) == len(set(got))
    return got


def test_parts_merge_in_input_order_cascade_and_end_as_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(rowfiles, "ROW_GROUP_ROWS", 7)
    rec = Records(tmp_path)
    ids = [f"p{i:03d}" for i in range(100)]
    finish = ids[:]
    random.Random(0).shuffle(finish)  # prompts finish in any order
    for k in range(0, 96, 12):  # 8 merges of 12 parts: the 8th level-1 file cascades into one of level 2
        for pid in finish[k:k + 12]:
            rec.write_output(_row(pid))
        res = rec.compact(ids, finish[k:k + 12])
        assert res.lost == [] and sorted(res.merged_parts) == sorted(finish[k:k + 12])
        assert not os.listdir(rec.done)  # merged rows need no markers
    parts, merged = _files(rec)
    assert parts == [] and [m.split(".")[1] for m in merged] == ["2"]
    for pid in finish[96:]:
        rec.write_output(_row(pid))
    assert _ids(rec, ids) == sorted(finish)  # input order, each once, parts and merged files alike
    rec.compact(ids, None, everything=True)
    parts, merged = _files(rec)
    assert parts == [] and len(merged) == 1
    pf = pq.ParquetFile(rec.outputs / merged[0])
    assert pf.metadata.num_rows == 100 and pf.metadata.num_row_groups == 15  # groups of at most 7 rows
    assert pf.read(columns=["id"]).column(0).to_pylist() == ids
    assert rec.read_outputs(ids).column("token_ids").to_pylist() == [_row(i)["token_ids"] for i in ids]
    mtime = (rec.outputs / merged[0]).stat().st_mtime_ns
    rec.compact(ids, None, everything=True)  # nothing to do: nothing rewritten
    assert _files(rec)[1] == merged and (rec.outputs / merged[0]).stat().st_mtime_ns == mtime


def test_outputs_are_one_parquet_dataset_for_pyarrow_pandas_and_duckdb(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    pd = pytest.importorskip("pandas")
    rec = Records(tmp_path)
    ids = [f"id-{i}" for i in range(40)]
    for pid in ids[:30]:
        rec.write_output(_row(pid, n=3))
    rec.compact(ids, ids[:30])
    for pid in ids[30:]:
        rec.write_output(_row(pid, n=3))  # a merged file and parts side by side
    glob = str(rec.outputs / "*.parquet")
    t = pq.read_table(rec.outputs)
    assert sorted(t.column("id").to_pylist()) == sorted(ids)
    df = pd.read_parquet(rec.outputs)
    assert len(df) == 40 and set(df["id"]) == set(ids) and df["n_tokens"].eq(3).all()
    con = duckdb.connect()
    n, distinct, tokens = con.execute(f"select count(*), count(distinct id), sum(len(token_ids)) "
                                      f"from read_parquet('{glob}')").fetchone()
    assert (n, distinct, tokens) == (40, 40, 120)
    first = con.execute(f"select token_ids from read_parquet('{glob}') where id = 'id-7'").fetchone()[0]
    assert first == _row("id-7", n=3)["token_ids"]


def test_a_crash_between_a_merge_and_its_removals_never_duplicates_a_row(tmp_path, monkeypatch):
    rec = Records(tmp_path)
    ids = [f"p{i}" for i in range(20)]
    for pid in ids:
        rec.write_output(_row(pid))
    with monkeypatch.context() as m:  # the merged file is written, then the process "dies" before any removal
        m.setattr("pathlib.Path.unlink", lambda self, missing_ok=False: None)
        rec.compact(ids, ids[:12])
    parts, merged = _files(rec)
    assert len(parts) == 20 and len(merged) == 1  # 12 rows are in two files now
    assert _ids(rec, ids) == ids
    scan = rec.repair(ids)  # the next run: the covered parts go
    assert set(scan.rows) == set(ids) and scan.in_parts == set(ids[12:])
    assert len(_files(rec)[0]) == 8 and _ids(rec, ids) == ids


def test_readers_never_miss_or_repeat_a_row_while_compactions_run(tmp_path, monkeypatch):
    """A writer finishes prompts and compacts (small fanout: merges of merges) while readers stream the outputs: every
    read holds each row at most once, and every row finished before the read started."""
    monkeypatch.setattr(rowfiles, "ROW_GROUP_ROWS", 5)
    rec = Records(tmp_path)
    ids = [f"p{i:03d}" for i in range(240)]
    order = ids[:]
    random.Random(1).shuffle(order)
    finished: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer():
        try:
            for k in range(0, len(order), 8):
                for pid in order[k:k + 8]:
                    rec.write_output(_row(pid))
                    finished.append(pid)
                compact(rec.store, {}, lambda i: (ids.index(i), i), None, fanout=3)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            stop.set()

    reads = 0
    t = threading.Thread(target=writer)
    t.start()
    try:
        while not stop.is_set():
            before = set(finished)
            got = [i for i, _ in rec.iter_outputs(ids)]
            assert len(got) == len(set(got)), "a row was read twice"
            assert before <= set(got), f"rows missed: {sorted(before - set(got))[:5]}"
            assert got == sorted(got)
            reads += 1
    finally:
        t.join()
    assert not errors and reads >= 3
    assert _ids(rec, ids) == ids


def test_an_unreadable_row_group_of_a_merged_file_loses_only_its_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(rowfiles, "ROW_GROUP_ROWS", 4)
    rec = Records(tmp_path)
    ids = [f"p{i:02d}" for i in range(12)]
    for pid in ids:
        rec.write_output(_row(pid, n=200))
    rec.compact(ids, None, everything=True)
    (name,) = _files(rec)[1]
    path = rec.outputs / name
    flip_last_page(path, row_group=1)  # token_ids of rows 4..7
    problems = []
    assert [i for i, _ in rec.iter_outputs(ids, problems=problems)] == ids[:4] + ids[8:]
    assert problems and "row group 1" in problems[0]
    scan = rec.repair(ids)  # keeps the readable rows in a new file, sets the damaged one aside
    assert set(scan.rows) == set(ids[:4] + ids[8:]) and scan.problems
    assert path.with_name(name + ".corrupt").exists() and _ids(rec, ids) == ids[:4] + ids[8:]
