"""Job directory: create/reuse/refuse with a diff, the driver lock, status and export over a hand-made job."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.export import export
from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.modelinfo import model_info
from specrun.jobs.status import job_status
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.storage.chunks import write_chunk
from specrun.storage.records import output_row


@pytest.fixture(scope="module")
def infos(tiny_models):
    return {n: model_info(tiny_models[n]) for n in ("llama_mha", "llama_gqa")}


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "prompt": "one"}\n{"id": "b", "prompt": "two", "max_tokens": 5}\n'
                 '{"id": "c", "input_ids": [5]}\n')
    return p


def _prepare(prompts, job, info, **params):
    params = SamplingParams(**{"max_tokens": 10, **params})
    return prepare_job(prompts, job, info, JobSettings(), params, EngineConfig())


def test_create_then_same_settings_reuse_then_differences_refused(infos, prompts, tmp_path):
    job_dir = tmp_path / "job"
    job, created = _prepare(prompts, job_dir, infos["llama_mha"])
    assert created and job.exists()
    manifest = job.manifest()
    assert manifest["model"]["fingerprint"] == infos["llama_mha"].fingerprint
    assert manifest["params"]["max_tokens"] == 10 and len(manifest["input"]["sha256"]) == 64
    assert [p.id for p in job.prompts()] == ["a", "b", "c"]
    before = {p: p.stat().st_mtime_ns for p in job_dir.rglob("*")}

    job2, created2 = _prepare(prompts, job_dir, infos["llama_mha"])
    assert not created2

    with pytest.raises(JobError) as e:
        _prepare(prompts, job_dir, infos["llama_mha"], temperature=0.7, seed=3)
    assert "params.temperature: job has 0.0, now 0.7" in str(e.value) and "params.seed" in str(e.value)
    with pytest.raises(JobError, match="model.fingerprint"):
        _prepare(prompts, job_dir, infos["llama_gqa"])
    prompts.write_text(prompts.read_text() + '{"id": "d", "prompt": "x"}\n')
    with pytest.raises(JobError, match="input.sha256"):
        _prepare(prompts, job_dir, infos["llama_mha"])
    assert {p: p.stat().st_mtime_ns for p in job_dir.rglob("*")} == before  # refusals changed nothing


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 0.0])
def test_job_settings_need_a_finite_positive_checkpoint_interval(seconds):
    with pytest.raises(ValueError, match="checkpoint_seconds=.* must be a finite number > 0"):
        JobSettings(checkpoint_seconds=seconds)


def test_non_job_directory_is_not_overwritten(infos, prompts, tmp_path):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    with pytest.raises(JobError, match="not a specrun job"):
        _prepare(prompts, tmp_path / "busy", infos["llama_mha"])


def test_lock_refuses_second_driver_and_takes_over_a_dead_ones(tmp_path):
    job = JobDir(tmp_path)
    job.acquire_lock()
    with pytest.raises(JobError, match=f"pid {os.getpid()}"):
        JobDir(tmp_path).acquire_lock()
    job.release_lock()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lock.json").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started_at": 0}))
    assert not job.driver_alive()
    job.acquire_lock()
    assert job.lock_owner()["pid"] == os.getpid()
    job.release_lock()
    assert not (tmp_path / "lock.json").exists()


def test_lock_of_another_host_is_respected(tmp_path):
    (tmp_path / "lock.json").write_text(json.dumps({"pid": 1, "host": "elsewhere", "started_at": 0}))
    with pytest.raises(JobError, match="elsewhere"):
        JobDir(tmp_path).acquire_lock()


def test_status_and_export_of_a_partly_done_job(infos, prompts, tmp_path):
    job, _ = _prepare(prompts, tmp_path / "job", infos["llama_mha"])
    job.records.write_output(output_row("b", [7, 8, 9], "xyz", "length", {"steps": 2, "tokens_per_s": 30.0},
                                        prompt_tokens=3, resumed_tokens=0, attempts=1))
    write_chunk(job.progress_dir("a"), 0, [1, 2, 3, 4])
    job.records.mark_failed("c", "ValueError: boom", 1)
    st = job_status(job)
    by_id = {r["id"]: r for r in st["prompts"]}
    assert by_id["a"]["state"] == "pending" and by_id["a"]["tokens"] == 4
    assert by_id["b"]["state"] == "done" and by_id["b"]["tokens"] == 3 and by_id["b"]["finish_reason"] == "length"
    assert by_id["c"]["state"] == "failed" and "boom" in by_id["c"]["error"]
    assert st["totals"]["done"] == 1 and st["totals"]["pending"] == 1 and st["totals"]["failed"] == 1
    # a live file with no driver holding the lock is an interrupted run: pending, not running
    job.records.write_live("a", {"tokens": 6, "updated_at": 1e12})
    assert {r["id"]: r for r in job_status(job)["prompts"]}["a"]["state"] == "pending"
    job.acquire_lock()
    try:
        assert {r["id"]: r for r in job_status(job)["prompts"]}["a"]["state"] == "running"
        job.records.write_live("a", {"tokens": 6, "updated_at": 1e12, "host": "h", "slot": 0, "tokens_per_s": 12.5})
        assert job_status(job)["workers"] == {"h/0": {"running": 1, "tokens_per_s": 12.5}}  # tok/s per worker
    finally:
        job.release_lock()

    out = tmp_path / "o.jsonl"
    assert export(job, "jsonl", str(out)) == (1, 2)
    row = json.loads(out.read_text())
    assert row["id"] == "b" and row["token_ids"] == [7, 8, 9] and row["stats"]["steps"] == 2
    assert export(job, "parquet", str(tmp_path / "o.parquet")) == (1, 2)
    assert pq.read_table(tmp_path / "o.parquet").column("text").to_pylist() == ["xyz"]
    with pytest.raises(ValueError, match="-o"):
        export(job, "parquet", None)
    assert export(job, "text", str(tmp_path / "o.txt")) == (1, 2)
    assert (tmp_path / "o.txt").read_text() == "=== b (3 tokens, length) ===\nxyz\n\n"


def test_params_added_later_count_at_their_default_in_an_old_manifest():
    from specrun.jobs.jobdir import manifest_differences

    new = {"params": {"temperature": 0.0, "stop": [], "stop_token_ids": []}}
    old = {"params": {"temperature": 0.0}}  # written before stop rules existed
    assert manifest_differences(old, new) == []
    assert manifest_differences(old, {"params": {"temperature": 0.0, "stop": ["x"]}}) == [
        "params.stop: job has [], now ['x']"]
