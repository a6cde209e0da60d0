"""Scale (issue 11, item 6), small enough for the suite: the driver's bookkeeping never scans the prompts per event;
a 200-prompt job compacts its outputs while it runs (merges and merges of merges) with readers streaming them at
the same time (never a row twice, never one missed), and ends with one Parquet file in input order, no progress
chunks, no markers, no live files; workers write their recycling matrix at a bounded cadence, not at every
checkpoint. The 10,000-prompt run is tests/faults/scale.py (run by hand).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import threading
import time

import pyarrow.parquet as pq
import pytest

import specrun.actors.worker as worker_mod
import specrun.storage.outputs as outputs
from specrun.actors.memory import AUTO_MAX
from specrun.actors.worker import GenerationWorker, WorkerSpec
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.driver import RunOptions, _Driver, run_job
from specrun.jobs.export import export
from specrun.jobs.inputs import PromptRecord
from specrun.jobs.jobdir import JobDir
from specrun.jobs.modelinfo import model_info
from specrun.jobs.progress import QuietView
from specrun.jobs.status import job_status
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.models.loader import load_model


class _NoScan(dict):
    """The driver's prompt table: once armed, iterating it (a scan of every prompt) fails the test."""
    armed = False

    def _scan(self, *a):
        assert not self.armed, "the driver scanned every prompt while handling one event"
        return a

    def __iter__(self):
        self._scan()
        return super().__iter__()

    def items(self):
        self._scan()
        return super().items()

    def values(self):
        self._scan()
        return super().values()

    def keys(self):
        self._scan()
        return super().keys()


def test_driver_bookkeeping_is_constant_per_event(tmp_path, monkeypatch):
    n = 20_000
    params = SamplingParams(max_tokens=4)
    job = JobDir(tmp_path / "job")
    job.create({"model": {}, "checkpoint": {}}, [PromptRecord(f"p{i}", i + 1, "x", (1, 2), {}, params)
                                                 for i in range(n)])
    d = _Driver(job, RunOptions(quiet=True), settings={})  # no worker is started: no attempt settings needed
    d.prompts = _NoScan(d.prompts)
    monkeypatch.setattr(d.rec, "write_output", lambda row: None)  # the files are not what is measured here
    monkeypatch.setattr(d.rec, "drop_progress", lambda pid: None)
    d.n_done_initial, d.done_tokens, d.tokens_left = 0, 0, n * 4
    d.compactor = type("C", (), {"add": lambda self, pid: None, "drain": lambda self: []})()
    d.display = QuietView()
    d.prompts.armed = True
    times = []
    for i in range(10_000):
        pid = f"p{i}"
        d.attempts[pid] = 1
        t = time.perf_counter()
        d._finish({"id": pid, "stopped": False, "token_ids": [1, 2, 3, 4], "text": "abcd", "finish_reason": "length",
                   "stats": {}, "resumed_tokens": 0})
        d._refresh({}, force=True)
        times.append(time.perf_counter() - t)
    first, last = sorted(times[:2000])[1000], sorted(times[-2000:])[1000]
    print(f"median per event: first 2000 {first * 1e6:.0f} us, last 2000 {last * 1e6:.0f} us")  # measured, not asserted
    assert d.tokens_left == (n - 10_000) * 4 and d.done_tokens == 40_000


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def test_a_200_prompt_job_compacts_while_readers_stream_and_ends_as_one_file(tmp_path, model, monkeypatch):
    monkeypatch.setattr(outputs, "PARTS_PER_MERGE", 20)  # background merges every 20 prompts ...
    monkeypatch.setattr(outputs, "FANOUT", 3)  # ... and merges of merges
    n = 200
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i:04d}", "prompt": f"prompt {i}"}) + "\n" for i in range(n)))
    job, _ = prepare_job(prompts, tmp_path / "job", model_info(model), JobSettings(checkpoint_every=2),
                         SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True), EngineConfig())
    ids = job.prompt_ids()
    finished = threading.Event()
    reads, errors, most_files = [0], [], [0]

    def reader():  # `specrun export` and `specrun status` from another terminal while the job runs
        try:
            while not finished.is_set():
                done_before = {r["id"] for r in job_status(job)["prompts"] if r["state"] == "done"}
                got = [pid for pid, _ in job.records.iter_outputs(ids)]
                assert len(got) == len(set(got)), "a row was read twice"
                assert done_before <= set(got), f"rows missed: {sorted(done_before - set(got))[:5]}"
                assert got == sorted(got)  # input order
                # os.walk skips a directory removed while it walks (a finished prompt's progress dir)
                most_files[0] = max(most_files[0], sum(len(files) for _, _, files in os.walk(job.root)))
                reads[0] += 1
                time.sleep(0.2)  # a user's terminal, not a busy loop competing with the driver for the GIL
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        summary = run_job(job, RunOptions(actors=1, quiet=True))
    finally:
        finished.set()
        t.join(60)
    print(f"{n} prompts in {time.monotonic() - t0:.1f}s; {reads[0]} concurrent reads; at most {most_files[0]} files")
    assert not errors, errors[0]
    assert summary.exit_code == 0 and len(summary.done) == n and reads[0] >= 2
    # parts, their markers and the finished prompts' timelines never pile up past a merge (20 each at most between
    # merges, and at most timeline.MAX_MERGED merged timeline files), plus each prompt in flight's chunks, live status
    # and timeline (--concurrency auto runs up to AUTO_MAX at once): a bound that does not grow with the prompts
    assert most_files[0] < 3 * 20 + 30 + 5 * AUTO_MAX["cpu"]
    left = sorted(str(f.relative_to(job.root)) for f in job.root.rglob("*") if f.is_file())
    assert sorted({f.split("/")[0] for f in left}) == ["attempts", "job.json", "outputs", "prompts.parquet", "state",
                                                      "timeline"], left
    assert len([f for f in left if f.startswith("outputs/")]) == 1, left
    assert len([f for f in left if f.startswith("timeline/")]) == 1, left  # every prompt's timeline in one file

    out = tmp_path / "out.parquet"
    assert export(job, "parquet", str(out)) == (n, 0)
    rows = pq.read_table(out)
    assert rows.column("id").to_pylist() == ids
    merged = pq.read_table(job.records.outputs)
    assert merged.column("id").to_pylist() == ids and merged.schema.equals(rows.schema)
    engine = Engine(load_model(model))
    by_id = {p.id: p for p in job.prompts()}
    for i in random.Random(0).sample(range(n), 20):
        p = by_id[ids[i]]
        assert rows.column("token_ids")[i].as_py() == engine.generate(list(p.input_ids), p.params).token_ids


def test_matrix_snapshots_are_rate_limited_not_written_at_every_checkpoint(model, tmp_path, monkeypatch):
    writes = []
    real = worker_mod.save_matrix
    monkeypatch.setattr(worker_mod, "save_matrix", lambda *a, **kw: writes.append(1) or real(*a, **kw))
    # the n-gram and recycling drafters: about a token a step, so ~10 checkpoints a prompt (the 4-bit chain takes
    # several a step)
    spec = WorkerSpec(job_dir=str(tmp_path), model=model, fingerprint=model_info(model).fingerprint,
                      checkpoint_every=4, snapshot_seconds=3600, engine={"drafters": ["ngram", "recycling"]})
    w = GenerationWorker(spec, slot=0)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)
    for i in range(3):
        res = w.generate({"id": f"p{i}", "input_ids": [1, 2, 3], "params": dataclasses.asdict(params),
                          "resume_from": []})
        assert len(res["token_ids"]) == 40
    assert len(list((tmp_path / "progress").glob("*/chunk-*"))) >= 27  # ~30 checkpoints ...
    assert len(writes) == 1  # ... one matrix write (the first checkpoint: a fresh worker has none)
    w.save_state()  # the driver's call at the end of a run
    assert len(writes) == 2
    w.request_stop()  # a stop always writes it
    res = w.generate({"id": "p9", "input_ids": [4, 5], "params": dataclasses.asdict(params), "resume_from": []})
    assert res["stopped"] and len(writes) == 3
