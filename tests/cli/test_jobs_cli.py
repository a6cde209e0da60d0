"""`specrun submit/resume/status/export` end to end: the driver SIGKILLed mid-run then resumed, a worker process
killed mid-generation, a second driver refused, different model/params refused, piped input hashed as read (other
piped content refused), trust_remote_code never taken from job.json alone. Drivers run as subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.jobs.jobdir import JobDir
from specrun.storage.chunks import read_progress

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [{"id": "alpha", "prompt": "Once upon a time"}, {"id": "beta", "prompt": "abc abc"},
           {"id": "gamma/3", "prompt": "The end.", "max_tokens": 700}]
FLAGS = ["--max-tokens", "1000", "--temperature", "1.0", "--seed", "42", "--ignore-eos", "--checkpoint-every", "32",
         "--actors", "2", "--draft", "ngram,recycling"]


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_mha"]


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    return p


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """Uninterrupted outputs for PROMPTS + FLAGS, made in-process by the engine (prompt seeds as the job derives)."""
    import torch

    from specrun.decoding.engine import Engine
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.inputs import read_prompts
    from specrun.jobs.modelinfo import model_info
    from specrun.models.loader import load_model

    d = tmp_path_factory.mktemp("ref")
    (d / "p.jsonl").write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    info = model_info(model)
    recs, _ = read_prompts(d / "p.jsonl", info.tokenizer, info.max_context, info.vocab_size,
                        SamplingParams(max_tokens=1000, temperature=1.0, seed=42, ignore_eos=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(load_model(model))
        return {r.id: engine.generate(list(r.input_ids), r.params).token_ids for r in recs}
    finally:
        torch.set_num_threads(threads)


def _cmd(*args) -> list[str]:
    return [sys.executable, "-c", "from specrun.cli import main; main()", *map(str, args)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def _start(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen(_cmd(*args), env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _end_group(p: subprocess.Popen) -> None:
    """Kill what is left of a driver we started (its local Ray helpers share its process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _wait_for(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _outputs(job_dir: Path) -> dict[str, dict]:
    rows = JobDir(job_dir).records.read_outputs().to_pylist()
    assert len(rows) == len({r["id"] for r in rows}) == len(PROMPTS)  # nothing lost, nothing duplicated
    return {r["id"]: r for r in rows}


def test_driver_sigkill_then_resume_is_identical_and_regenerates_nothing_checkpointed(model, prompts_file, tmp_path,
                                                                                      reference):
    job_dir = tmp_path / "job"
    t0 = time.monotonic()
    p = _start(["submit", prompts_file, "--model", model, "--job-dir", job_dir, *FLAGS], tmp_path / "submit.log")
    try:
        _wait_for(lambda: len(list(job_dir.glob("progress/*/chunk-*"))) >= 3, 180, "three checkpoint chunks")
        os.kill(p.pid, signal.SIGKILL)
        t_kill = time.monotonic() - t0
    finally:
        _end_group(p)
    job = JobDir(job_dir)
    saved = {q.id: len(read_progress(job.progress_dir(q.id), quarantine=False)) for q in job.prompts()}
    assert sum(saved.values()) >= 96
    done_before = {q.id for q in job.prompts() if job.records.is_done(q.id)}

    st = json.loads(CliRunner().invoke(main, ["status", str(job_dir), "--json"]).stdout)
    assert not st["driver"]["running"]  # the dead driver's lock is stale
    assert {r["state"] for r in st["prompts"]} <= {"pending", "done"}

    t1 = time.monotonic()
    r = subprocess.run(_cmd("resume", job_dir), env=_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    out = _outputs(job_dir)
    for pid, toks in reference.items():
        row = out[pid]
        assert row["token_ids"] == toks, pid
        if pid not in done_before:  # every checkpointed token was re-prefilled, none regenerated
            assert row["resumed_tokens"] >= saved[pid]
            assert json.loads(row["stats"])["new_tokens"] == row["n_tokens"] - row["resumed_tokens"]
    print(f"\ntimeline: submit, SIGKILL at {t_kill:.1f}s with {saved} tokens checkpointed; "
          f"resume took {time.monotonic() - t1:.1f}s; resumed_tokens "
          f"{ {k: v['resumed_tokens'] for k, v in out.items()} }")

    exported = CliRunner().invoke(main, ["export", str(job_dir)]).stdout.strip().splitlines()
    assert sorted(json.loads(x)["id"] for x in exported) == sorted(reference)


def test_killing_a_worker_process_mid_generation_still_completes_identically(model, prompts_file, tmp_path, reference):
    job_dir = tmp_path / "job"
    p = _start(["submit", prompts_file, "--model", model, "--job-dir", job_dir, *FLAGS], tmp_path / "submit.log")
    try:
        def busy_worker():
            for f in job_dir.glob("live/*.json"):
                try:
                    info = json.loads(f.read_text())
                except ValueError:
                    continue
                if info.get("checkpointed", 0) >= 32 and info["tokens"] < info["max_tokens"] - 200:
                    return info
            return None

        victim = _wait_for(busy_worker, 180, "a worker with a checkpoint")
        os.kill(victim["pid"], signal.SIGKILL)
        rc = p.wait(timeout=400)
    finally:
        _end_group(p)
    assert rc == 0, (tmp_path / "submit.log").read_text()
    out = _outputs(job_dir)
    for pid, toks in reference.items():
        assert out[pid]["token_ids"] == toks, pid
    row = out[victim["id"]]
    assert row["attempts"] == 2 and row["resumed_tokens"] >= victim["checkpointed"]
    assert "worker lost" in (tmp_path / "submit.log").read_text()


def test_second_driver_and_changed_model_or_params_are_refused(model, tiny_models, prompts_file, tmp_path):
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job

    job_dir = tmp_path / "job"
    job, _ = prepare_job(prompts_file, job_dir, model_info(model), JobSettings(checkpoint_every=32),
                         SamplingParams(max_tokens=1000, temperature=1.0, seed=42, ignore_eos=True),
                         EngineConfig(drafters=("ngram", "recycling")))
    job.acquire_lock()  # this test process plays the running driver
    try:
        for args in (["resume", str(job_dir)],
                     ["submit", str(prompts_file), "--model", model, "--job-dir", str(job_dir), *FLAGS]):
            r = CliRunner().invoke(main, args)
            assert r.exit_code != 0 and f"being run by another driver (pid {os.getpid()}" in r.output, r.output
    finally:
        job.release_lock()
    snapshot = {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")}
    r = CliRunner().invoke(main, ["resume", str(job_dir), "--model", tiny_models["llama_gqa"]])
    assert r.exit_code != 0 and "is not the job's model" in r.output
    flags = [x if x != "1.0" else "0.5" for x in FLAGS]
    r = CliRunner().invoke(main, ["submit", str(prompts_file), "--model", model, "--job-dir", str(job_dir), *flags])
    assert r.exit_code != 0 and "params.temperature: job has 1.0, now 0.5" in r.output
    r = CliRunner().invoke(main, ["submit", str(prompts_file), "--model", tiny_models["llama_gqa"],
                                  "--job-dir", str(job_dir), *FLAGS])
    assert r.exit_code != 0 and "model.fingerprint" in r.output
    from specrun.cli.options import Concurrency

    assert [Concurrency().convert(v, None, None) for v in ("auto", "AUTO", "3", 2)] == ["auto", "auto", 3, 2]
    for bad in ("0", "many", "2.5"):
        r = CliRunner().invoke(main, ["resume", str(job_dir), "--concurrency", bad])
        assert r.exit_code == 2 and f"'{bad}' is not an integer >= 1 or 'auto'" in r.output, r.output
    assert {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")} == snapshot


def _fifo(path: Path, data: bytes) -> Path:
    """A named pipe fed by a writer thread: its first reader gets data, a second one (there must be none) nothing."""
    os.mkfifo(path)

    def feed():
        for payload in (data, b""):
            with open(path, "wb") as f:
                f.write(payload)

    threading.Thread(target=feed, daemon=True).start()
    return path


def test_piped_input_is_hashed_as_read_and_other_piped_content_is_refused(model, tmp_path):
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job

    def prepare(path):
        return prepare_job(path, job_dir, model_info(model), JobSettings(), SamplingParams(max_tokens=8), EngineConfig())

    job_dir = tmp_path / "job"
    content = "".join(json.dumps(x) + "\n" for x in PROMPTS).encode()
    job, created = prepare(_fifo(tmp_path / "in1", content))
    assert created and job.manifest()["input"]["sha256"] == hashlib.sha256(content).hexdigest()
    assert [p.id for p in job.prompts()] == [x["id"] for x in PROMPTS]
    snapshot = {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")}

    other = content.replace(b"Once upon", b"Twice upon")
    r = CliRunner().invoke(main, ["submit", str(_fifo(tmp_path / "in2", other)), "--model", model, "--job-dir",
                                  str(job_dir), "--max-tokens", "8", "--dtype", "float32"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), r.output
    assert f"input.sha256: job has '{hashlib.sha256(content).hexdigest()}', now " \
           f"'{hashlib.sha256(other).hexdigest()}'" in r.output
    assert not prepare(_fifo(tmp_path / "in3", content))[1]  # the same content piped again is the same job
    assert {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")} == snapshot


def test_trust_remote_code_is_never_taken_from_job_json_alone(model, tiny_models, prompts_file, tmp_path):
    from specrun.decoding.engine import EngineConfig
    from specrun.decoding.verify.params import SamplingParams
    from specrun.jobs.modelinfo import model_info
    from specrun.jobs.submit import JobSettings, prepare_job

    job_dir = tmp_path / "job"
    prepare_job(prompts_file, job_dir, model_info(model), JobSettings(trust_remote_code=True),
                SamplingParams(max_tokens=8), EngineConfig())
    snapshot = {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")}
    for args in (["resume", job_dir],
                 ["submit", prompts_file, "--model", model, "--job-dir", job_dir, "--max-tokens", "8", "--dtype",
                  "float32"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert r.exit_code == 1 and "runs its model with --trust-remote-code" in r.output, r.output
        assert "give --trust-remote-code again" in r.output
    assert {f: f.stat().st_mtime_ns for f in job_dir.rglob("*")} == snapshot  # nothing started: no lock, no output
    # with the flag the resume gets past that gate (and here stops at the next one: another model)
    r = CliRunner().invoke(main, ["resume", str(job_dir), "--trust-remote-code", "--model", tiny_models["llama_gqa"]])
    assert r.exit_code == 1 and "is not the job's model" in r.output, r.output


def test_help_has_examples():
    for cmd in ("submit", "resume", "status", "export"):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0 and "Examples:" in r.output and "specrun " + cmd in r.output


def test_resumes_help_gives_the_jobs_settings_as_the_default_of_the_flags_that_keep_them():
    """A flag left out of a resume keeps the job's value (device, drafting, checkpoints): its help says so and shows
    no submit default; Ray flags are the run's and keep theirs."""
    resume = {p.name: p for p in main.commands["resume"].params}
    submit = {p.name: p for p in main.commands["submit"].params}
    for name in ("checkpoint_every", "checkpoint_seconds", "draft", "trie_budget", "attention", "fixed_budget"):
        assert not resume[name].show_default and resume[name].help.endswith("Default: the job's."), name
        assert "Default: the job's." not in (submit[name].help or ""), name
    assert submit["checkpoint_every"].show_default and resume["concurrency"].show_default
    text = CliRunner().invoke(main, ["resume", "--help"]).output
    assert "[default: 2048" not in text and "Default: the job's." in text
