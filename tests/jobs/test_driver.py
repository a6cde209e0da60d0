"""The driver on a local Ray (one per module): 2 actors == `specrun generate`, application errors, corrupt chunks,
Ctrl-C checkpoint-and-stop then resume; every prompt's output row exists exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pyarrow as pa
import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.sampling import SamplingParams
from specrun.jobs.driver import EXIT_FAILED, EXIT_INTERRUPTED, RunOptions, _Interrupts, run_job
from specrun.jobs.modelinfo import model_info
from specrun.jobs.status import job_status
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.storage.atomic import atomic_write_table
from specrun.storage.schemas import PROMPTS

ray = pytest.importorskip("ray")
QUIET = RunOptions(quiet=True)


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=max(2, os.cpu_count() or 1))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


def _job(tmp_path, model, lines, every=16, **params):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    settings = JobSettings(checkpoint_every=every)
    job, _ = prepare_job(path, tmp_path / "job", model_info(model), settings, SamplingParams(**params), EngineConfig())
    return job


def _outputs(job) -> dict[str, dict]:
    rows = job.records.read_outputs().to_pylist()
    assert len(rows) == len({r["id"] for r in rows})  # exactly once
    return {r["id"]: r for r in rows}


def test_two_actor_job_equals_specrun_generate(tmp_path, model):
    lines = [
        {"id": "greedy", "prompt": "The quick brown fox", "temperature": 0.0},
        {"id": "sampled", "prompt": "Once upon a time"},
        {"id": "own-seed", "prompt": "abcabcabc", "seed": 123, "top_k": 20, "max_tokens": 40},
        {"id": "penalty", "prompt": "hello hello", "penalty": 1.3, "penalty_window": 16, "top_p": 0.9},
        {"id": "short", "prompt": "x", "max_tokens": 3},
    ]
    job = _job(tmp_path, model, lines, max_tokens=60, temperature=0.9, seed=7)
    summary = run_job(job, RunOptions(actors=2, quiet=True))
    assert summary.exit_code == 0 and sorted(summary.done) == sorted(x["id"] for x in lines)
    out = _outputs(job)
    for p in job.prompts():
        sp = p.params
        args = ["generate", "--prompt", p.text, "--model", model, "--max-tokens", str(sp.max_tokens), "--json",
                "--draft", "ngram,recycling",
                "--temperature", str(sp.temperature), "--top-k", str(sp.top_k), "--top-p", str(sp.top_p),
                "--penalty", str(sp.penalty), "--penalty-window", str(sp.penalty_window), "--seed", str(sp.seed)]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        ref = json.loads(r.stdout.strip().splitlines()[-1])
        row = out[p.id]
        assert row["token_ids"] == ref["token_ids"], p.id
        assert row["text"] == ref["text"] and row["finish_reason"] == ref["finish_reason"]
        assert row["n_tokens"] == len(ref["token_ids"]) and row["resumed_tokens"] == 0 and row["attempts"] == 1
        assert 0 < row["distinct_1"] <= 1 and row["steps"] > 0
    assert out["sampled"]["token_ids"] != out["greedy"]["token_ids"]
    st = job_status(job)
    assert st["totals"]["done"] == len(lines) and not st["driver"]["running"]
    # a second run finds nothing to do and writes nothing
    mtimes = {f: f.stat().st_mtime_ns for f in (job.root / "outputs").iterdir()}
    assert run_job(job, QUIET).exit_code == 0
    assert {f: f.stat().st_mtime_ns for f in (job.root / "outputs").iterdir()} == mtimes


def test_corrupt_chunks_are_regenerated_and_others_left_alone(tmp_path, model):
    job = _job(tmp_path, model, [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}],
               max_tokens=120, temperature=1.0, seed=1, ignore_eos=True)
    assert run_job(job, QUIET).exit_code == 0
    ref = _outputs(job)
    # "a" lost its output, and two of its chunks are damaged: one truncated, one overwritten with garbage
    key = job.progress_dir("a").name
    (job.root / "done" / f"{key}.json").unlink()
    (job.root / "outputs" / f"{key}.parquet").unlink()
    chunks = sorted(job.progress_dir("a").iterdir())
    assert len(chunks) >= 4
    chunks[1].write_bytes(chunks[1].read_bytes()[:-30])
    chunks[3].write_bytes(b"not parquet")
    keep = int(chunks[1].name.split("-")[1])  # tokens before the first bad chunk
    b_mtime = (job.root / "outputs" / f"{job.progress_dir('b').name}.parquet").stat().st_mtime_ns

    assert run_job(job, QUIET).exit_code == 0
    out = _outputs(job)
    assert out["a"]["token_ids"] == ref["a"]["token_ids"]
    assert out["a"]["resumed_tokens"] == keep
    assert json.loads(out["a"]["stats"])["new_tokens"] == 120 - keep
    assert (job.progress_dir("a") / (chunks[1].name + ".corrupt")).exists()
    assert (job.root / "outputs" / f"{job.progress_dir('b').name}.parquet").stat().st_mtime_ns == b_mtime


def test_application_error_fails_only_that_prompt(tmp_path, model):
    job = _job(tmp_path, model, [{"id": "ok", "prompt": "fine"}, {"id": "bad", "prompt": "broken"}], max_tokens=10)
    # damage the stored prompt after validation: the engine rejects the token id
    rows = [dict(r, input_ids=[10**6]) if r["id"] == "bad" else r for r in
            pa.parquet.read_table(job.prompts_path).to_pylist()]
    atomic_write_table(job.prompts_path, pa.Table.from_pylist(rows, schema=PROMPTS))
    summary = run_job(job, QUIET)
    assert summary.exit_code == EXIT_FAILED and list(summary.failed) == ["bad"] and summary.done == ["ok"]
    assert "outside the model vocabulary" in summary.failed["bad"]
    st = {r["id"]: r for r in job_status(job)["prompts"]}
    assert st["bad"]["state"] == "failed" and "vocabulary" in st["bad"]["error"] and st["ok"]["state"] == "done"


def _reference(job, model) -> dict[str, list[int]]:
    """Uninterrupted generation of every prompt of the job, in-process (no Ray)."""
    from specrun.decoding.engine import Engine
    from specrun.decoding.models import load_model

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the workers: one thread each (far faster on a busy small machine)
    try:
        engine = Engine(load_model(model))
        return {p.id: engine.generate(list(p.input_ids), p.params).token_ids for p in job.prompts()}
    finally:
        torch.set_num_threads(threads)


def test_ctrl_c_checkpoints_stops_and_resume_finishes_identically(tmp_path, model):
    lines = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "second"}]
    job = _job(tmp_path, model, lines, every=32, max_tokens=400, temperature=1.0, seed=3, ignore_eos=True)

    def interrupt_after_first_chunk():
        while not list((job.root / "progress").glob("*/chunk-*")):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_after_first_chunk, daemon=True).start()
    t0 = time.monotonic()
    summary = run_job(job, RunOptions(actors=2, quiet=True))
    t1 = time.monotonic()
    assert summary.exit_code == EXIT_INTERRUPTED and summary.stopped
    stopped_at = {r["id"]: r["tokens"] for r in job_status(job)["prompts"]}
    assert not job.lock_path.exists()

    assert run_job(job, RunOptions(actors=2, quiet=True)).exit_code == 0
    t2 = time.monotonic()
    out, ref = _outputs(job), _reference(job, model)
    print(f"interrupted run {t1 - t0:.1f}s, resume {t2 - t1:.1f}s, reference {time.monotonic() - t2:.1f}s")
    for pid in ("a", "b"):
        assert out[pid]["token_ids"] == ref[pid]
    for pid in summary.stopped:
        assert out[pid]["resumed_tokens"] >= stopped_at[pid] > 0  # stop flushed every token; none regenerated


def test_second_ctrl_c_stops_at_once():
    with _Interrupts() as intr:
        assert signal.getsignal(signal.SIGINT) == intr._handle
        intr._handle(signal.SIGINT, None)
        assert intr.requested
        with pytest.raises(KeyboardInterrupt):
            intr._handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) != intr._handle
