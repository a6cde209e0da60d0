"""Finished prompts' timelines merged into timeline/merged.*.parquet (storage/timeline.py): one file with the prompt
ids, own files of running prompts untouched, no row lost or shown twice after a crash at any point or while a reader
reads, a prompt finished again shows its newest rows, the number of merged files stays bounded; on S3 too."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import specrun.storage.timeline as timeline_mod
from specrun.storage.atomic import atomic_write_table
from specrun.storage.fs import fs_of, job_path
from specrun.storage.schemas import MERGED_TIMELINE, TIMELINE
from specrun.storage.timeline import MERGED, merge_timelines, read_timelines, timeline_path

IDS = ["a/1", "b", "c", "running"]


def _rows(n_chunks: int, attempt: int = 1, seconds: float = 1.0) -> list[dict]:
    return [{"attempt": attempt, "start": 4 * i, "end": 4 * i + 4, "steps": 2, "seconds": seconds, "ended_at": 1e9 + i,
             "phase_seconds": {"verify": 0.5}, "accepted_by_drafter": {"ngram": i}, "width_steps": {1: 2},
             "host": "h", "slot": 0, "nodes": 3, "rss_mb": 100.0 + i} for i in range(n_chunks)]


def _write_own(root, pid: str, rows: list[dict]) -> None:
    atomic_write_table(timeline_path(root, pid), pa.Table.from_pylist(rows, schema=TIMELINE))


def _files(root) -> list[str]:
    return sorted(os.listdir(root / "timeline"))


def _merged(root) -> list[str]:
    return [n for n in _files(root) if MERGED.match(n)]


@pytest.fixture
def job(tmp_path):
    rows = {pid: _rows(2 + i, seconds=float(i)) for i, pid in enumerate(IDS)}
    for pid, rs in rows.items():
        _write_own(tmp_path, pid, rs)
    return tmp_path, rows


def test_finished_prompts_move_into_one_merged_file_with_their_ids(job):
    root, rows = job
    merge_timelines(root, ["a/1", "b", "c", "never-ran"])
    assert _files(root) == sorted([*_merged(root), timeline_path(root, "running").name]) and len(_merged(root)) == 1
    table = pq.read_table(root / "timeline" / _merged(root)[0])
    assert table.schema.equals(MERGED_TIMELINE) and sorted(set(table.column("id").to_pylist())) == ["a/1", "b", "c"]
    assert read_timelines(root, IDS) == rows  # the running prompt from its own file, the others from the merged one
    merge_timelines(root, IDS, fold=True)  # the job is done: everything in one file
    assert len(_files(root)) == 1 and read_timelines(root, IDS) == rows


def test_files_written_before_the_nodes_and_memory_fields_read_and_merge_with_them_empty(job):
    root, rows = job
    old_schema = pa.schema([f for f in TIMELINE if f.name not in ("nodes", "rss_mb")])
    old = [{k: v for k, v in r.items() if k in old_schema.names} for r in _rows(3)]
    atomic_write_table(timeline_path(root, "b"), pa.Table.from_pylist(old, schema=old_schema))
    expected = [r | {"nodes": None, "rss_mb": None} for r in old]
    assert read_timelines(root, ["b"]) == {"b": expected}
    merge_timelines(root, IDS, fold=True)
    assert read_timelines(root, IDS) == rows | {"b": expected}


def test_a_crash_at_any_point_loses_no_row_and_shows_none_twice(job, monkeypatch):
    root, rows = job
    real = timeline_mod.atomic_write_table

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(timeline_mod, "atomic_write_table", full)  # the merged file cannot be written
    with pytest.raises(OSError):
        merge_timelines(root, IDS[:3])
    assert _merged(root) == [] and read_timelines(root, IDS) == rows
    monkeypatch.setattr(timeline_mod, "atomic_write_table", real)

    saved = {pid: timeline_path(root, pid).read_bytes() for pid in IDS}
    merge_timelines(root, IDS[:3])
    for pid in IDS[:3]:  # killed after the merged file was written, before the own files were removed
        timeline_path(root, pid).write_bytes(saved[pid])
    assert read_timelines(root, IDS) == rows
    merge_timelines(root, IDS[:3])  # the next merge: a newer file holds them, still shown once
    assert len(_merged(root)) == 2 and read_timelines(root, IDS) == rows
    merge_timelines(root, IDS, fold=True)
    assert len(_files(root)) == 1 and read_timelines(root, IDS) == rows
    assert pq.read_table(root / "timeline" / _merged(root)[0]).num_rows == sum(map(len, rows.values()))


def test_a_prompt_finished_again_shows_its_newest_rows(job):
    root, rows = job
    merge_timelines(root, ["b"])
    new = _rows(5, seconds=9.0)  # its output was lost and it was generated again
    _write_own(root, "b", new)
    merge_timelines(root, ["b"])
    assert len(_merged(root)) == 2 and read_timelines(root, ["b"]) == {"b": new}
    merge_timelines(root, IDS, fold=True)
    assert read_timelines(root, IDS) == rows | {"b": new}


def test_merged_files_stay_bounded_and_a_damaged_one_is_skipped_then_set_aside(tmp_path):
    ids = [f"p{i}" for i in range(3 * timeline_mod.MAX_MERGED)]
    rows = {pid: _rows(1 + i % 3) for i, pid in enumerate(ids)}
    most = 0
    for pid in ids:  # one merge per finished prompt
        _write_own(tmp_path, pid, rows[pid])
        merge_timelines(tmp_path, [pid])
        most = max(most, len(_files(tmp_path)))
    assert most == timeline_mod.MAX_MERGED and read_timelines(tmp_path, ids) == rows
    damaged = tmp_path / "timeline" / _merged(tmp_path)[-1]
    lost = set(pq.read_table(damaged).column("id").to_pylist())
    damaged.write_bytes(damaged.read_bytes()[:-20])
    assert read_timelines(tmp_path, ids) == {pid: rs for pid, rs in rows.items() if pid not in lost}
    merge_timelines(tmp_path, ids, fold=True)
    assert _files(tmp_path) == sorted([_merged(tmp_path)[0], damaged.name + ".corrupt"])
    assert read_timelines(tmp_path, ids) == {pid: rs for pid, rs in rows.items() if pid not in lost}


def _read_during_a_fold(root, rows: dict, monkeypatch) -> None:
    """Three finished prompts merged one by one, then read while the driver's compaction folds every merged file just
    as the reader opens one (an object store does not keep a removed object readable): the reader lists again."""
    for pid in IDS[:3]:
        merge_timelines(root, [pid])
    real, folded = timeline_mod._read_merged, []

    def fold_first(path):
        if not folded:
            folded.append(path.name)
            merge_timelines(root, IDS[:3], fold=True)
        return real(path)

    monkeypatch.setattr(timeline_mod, "_read_merged", fold_first)
    assert read_timelines(root, IDS) == rows
    names = fs_of(root).list(root / "timeline")
    assert folded[0] not in names and len(names) == 2 and timeline_path(root, IDS[3]).name in names
    assert len([n for n in names if MERGED.match(n)]) == 1


def test_a_reader_during_a_fold_sees_every_row_once(job, monkeypatch):
    _read_during_a_fold(*job, monkeypatch)


def test_on_an_object_store_too(monkeypatch):
    from tests.s3server import local_s3

    with local_s3(endpoint_env=True) as s3:
        root = job_path(f"s3://{s3.bucket()}/jobs/j")
        rows = {pid: _rows(2 + i) for i, pid in enumerate(IDS)}
        for pid, rs in rows.items():
            _write_own(root, pid, rs)
        _read_during_a_fold(root, rows, monkeypatch)
