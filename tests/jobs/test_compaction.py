"""The driver's Compactor (no Ray): finished prompts' timelines follow their output rows into merged files, and a
finished job ends with one output file and one timeline file, own timelines that a killed run left behind included."""

from __future__ import annotations

import os

import pyarrow as pa

from specrun.jobs.compaction import Compactor
from specrun.storage.atomic import atomic_write_table
from specrun.storage.records import Records, output_row
from specrun.storage.schemas import TIMELINE
from specrun.storage.timeline import MERGED, read_timelines, timeline_path

IDS = [f"p{i}" for i in range(6)]


def _finish(rec: Records, pid: str, n_chunks: int) -> list[dict]:
    """What a worker and the driver leave for a finished prompt: its timeline, then its output part."""
    rows = [{"attempt": 1, "start": 3 * i, "end": 3 * i + 3, "steps": 1, "seconds": 0.5, "ended_at": 1e9,
             "phase_seconds": {}, "accepted_by_drafter": {}, "width_steps": {1: 1}, "host": "h", "slot": 0,
             "nodes": 1, "rss_mb": 50.0}
            for i in range(n_chunks)]
    atomic_write_table(timeline_path(rec.root, pid), pa.Table.from_pylist(rows, schema=TIMELINE))
    rec.write_output(output_row(pid, list(range(3 * n_chunks)), pid, "length", {"steps": n_chunks}, prompt_tokens=1,
                                resumed_tokens=0, attempts=1))
    return rows


def _timeline_files(rec: Records) -> tuple[list[str], list[str]]:
    names = sorted(os.listdir(rec.root / "timeline"))
    return [n for n in names if not MERGED.match(n)], [n for n in names if MERGED.match(n)]


def test_timelines_follow_their_rows_and_a_finished_job_leaves_one_file(tmp_path):
    rec = Records(tmp_path)
    rows = {pid: _finish(rec, pid, 1 + i % 3) for i, pid in enumerate(IDS[:2])}  # a run killed before any merge
    scan = rec.repair(IDS)
    c = Compactor(rec, IDS, parts_per_merge=3)
    c.pending.extend(scan.in_parts)  # as the driver does on resume
    rows[IDS[2]] = _finish(rec, IDS[2], 2)
    c.add(IDS[2])  # the third part: a merge of the three parts and their timelines
    c.wait()
    rows[IDS[3]] = _finish(rec, IDS[3], 2)
    c.add(IDS[3])
    own, merged = _timeline_files(rec)
    assert own == [timeline_path(rec.root, IDS[3]).name] and len(merged) == 1 and not c.drain()
    assert read_timelines(rec.root, IDS) == rows

    # killed between an output merge and its timelines' merge: own files of merged rows are left
    c.finish(everything=False)
    rows[IDS[4]] = _finish(rec, IDS[4], 3)
    rows[IDS[5]] = _finish(rec, IDS[5], 1)
    c = Compactor(rec, IDS)
    rec.compact(IDS)
    assert len(_timeline_files(rec)[0]) == 2

    c.finish(everything=True)
    assert not c.drain() and len(os.listdir(rec.outputs)) == 1
    assert _timeline_files(rec)[0] == [] and len(_timeline_files(rec)[1]) == 1
    assert read_timelines(rec.root, IDS) == rows
