"""Job files on an object store (a local moto S3 server, plain s3:// URIs through AWS_ENDPOINT_URL): every job file
round-trips, a failed write leaves nothing, put-if-absent has exactly one winner (S3 conditional writes and the lease
object), the job lock refuses a second holder and takes over a stale one, readers re-snapshot when a compaction removes
an object they hold open, and bad locations are usage errors naming the value."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from click.testing import CliRunner

import specrun.storage.objectfs as objectfs
import specrun.storage.rowfiles as rowfiles
from specrun.cli import main
from specrun.storage.atomic import atomic_path, atomic_write_json, read_json
from specrun.storage.chunks import progress_count, read_progress, write_chunk
from specrun.storage.fs import ObjectPath, fs_of, job_path
from specrun.storage.lock import JobLock, LockHeld
from specrun.storage.names import id_key
from specrun.storage.records import Records, output_row
from specrun.storage.state import load_matrix, save_matrix
from tests.s3server import local_s3


@pytest.fixture(scope="module")
def s3():
    with local_s3(endpoint_env=True) as server:
        yield server


@pytest.fixture
def root(s3) -> ObjectPath:
    path = job_path(f"s3://{s3.bucket()}/jobs/j1")
    assert isinstance(path, ObjectPath) and str(path).startswith("s3://")
    return path


def _row(pid: str, n: int = 5) -> dict:
    return output_row(pid, list(range(n)), "x" * n, "length", {"steps": 2}, prompt_tokens=3, resumed_tokens=0,
                      attempts=1)


def test_job_files_round_trip(root):
    atomic_write_json(root / "job.json", {"a": 1})
    assert read_json(str(root / "job.json")) == {"a": 1}  # by URI too
    progress = root / "progress" / id_key("p")
    write_chunk(progress, 0, [1, 2, 3])
    write_chunk(progress, 3, [4, 5])
    write_chunk(progress, 9, [7])  # after a gap: another run's, set aside
    progress.fs.put(progress / "chunk-0000000005-0000000006.parquet", b"not parquet")
    assert progress_count(progress) == 6  # from the names alone
    assert read_progress(progress) == [1, 2, 3, 4, 5] and progress_count(progress) == 5
    names = sorted(fs_of(progress).list(progress))
    assert names == ["chunk-0000000000-0000000003.parquet", "chunk-0000000003-0000000005.parquet",
                     "chunk-0000000005-0000000006.parquet.corrupt", "chunk-0000000009-0000000010.parquet.stale"]

    rec = Records(root)
    ids = [f"p{i}" for i in range(6)]
    for pid in ids:
        rec.write_output(_row(pid))
    assert rec.is_done("p3") and rec.read_done("p3")["n_tokens"] == 5
    rec.compact(ids, everything=True)
    assert [n.split(".")[0] for n in rec.fs.list(rec.outputs)] == ["merged"]
    assert [pid for pid, _ in rec.iter_outputs(ids)] == ids and rec.marker_keys() == set()
    rec.drop_progress("p")
    assert fs_of(root).list(root / "progress") == []

    arrays = {"table": np.arange(12, dtype=np.int32).reshape(3, 4)}
    save_matrix(root / "state", 0, arrays, "fp-1")
    assert np.array_equal(load_matrix(root / "state", "fp-1", 0)["table"], arrays["table"])
    assert load_matrix(root / "state", "another-model", 0) is None


def test_a_failed_write_leaves_nothing(root):
    target = root / "outputs" / "x.parquet"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert not target.fs.exists(target) and target.fs.list(target.parent) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.fs.read(target) == b"whole"


@pytest.mark.parametrize("kind", ["S3 If-None-Match", "lease object"])
def test_put_if_absent_has_exactly_one_winner(root, kind, monkeypatch):
    fs = root.fs
    if kind == "lease object":  # the scheme of stores without conditional writes, on the same bucket
        monkeypatch.setattr(objectfs, "SETTLE_S", 0.5)
        fs = objectfs.ObjectFS(fs.pafs, fs.scheme, fs.query)
    else:
        assert isinstance(fs, objectfs.S3FS)
    path = ObjectPath(fs, f"{root.key}/lock.json")
    start, results = threading.Barrier(6), {}

    def race(i: int) -> None:
        start.wait()
        results[i] = fs.put_if_absent(path, f"writer {i}".encode())

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1 and fs.read(path) == f"writer {winners[0]}".encode()
    assert fs.put_if_absent(path, b"late") is False


def test_lock_refuses_a_second_holder_and_takes_over_a_stale_one(root):
    path = root / "lock.json"
    a = JobLock(path)
    a.acquire()
    try:
        with pytest.raises(LockHeld) as e:
            JobLock(path).acquire()
        assert e.value.owner["token"] == a.token and JobLock(path).held_by_live()
    finally:
        a.release()
    assert not path.fs.exists(path)
    path.fs.put(path, b'{"pid": 1, "host": "gone-elsewhere", "token": "t", "heartbeat_at": 0, "lease_s": 120}')
    b = JobLock(path)
    b.acquire()  # the other host's heartbeat is older than its lease
    assert read_json(path)["token"] == b.token
    b.release()
    assert path.fs.list(root) == []  # no claim objects left


def test_readers_take_a_new_snapshot_when_a_compaction_removes_an_object_they_hold_open(root, monkeypatch):
    monkeypatch.setattr(rowfiles, "ROW_GROUP_ROWS", 3)
    rec = Records(root)
    ids = [f"p{i:02d}" for i in range(20)]
    for batch in (ids[:10], ids[10:]):
        for pid in batch:
            rec.write_output(_row(pid))
        rec.compact(ids, batch)  # two merged files of level 1, row groups of 3 rows
    problems: list[str] = []
    reader = rec.iter_outputs(ids, problems=problems)
    got = [next(reader)[0]]  # both merged files are open now
    rec.compact(ids, everything=True)  # merges them into one and removes them: unreadable on S3 from here on
    got += [pid for pid, _ in reader]
    assert got == ids and problems == []


def test_bad_locations_are_usage_errors_naming_them(root):
    r = CliRunner().invoke(main, ["status", "hdfs://namenode/jobs/x"])
    assert r.exit_code == 2 and "hdfs://namenode/jobs/x" in r.output and "not an object store" in r.output
    r = CliRunner().invoke(main, ["status", f"s3://{root.key.split('/')[0]}"])
    assert r.exit_code == 2 and "not a bucket" in r.output
    r = CliRunner().invoke(main, ["status", str(root / "nothing-here")])
    assert r.exit_code == 1 and "is not a specrun job (no job.json)" in r.output
