"""The driver on a local Ray (one per module): 2 actors == `specrun generate`, application errors, corrupt chunks,
Ctrl-C (and SIGTERM, SIGHUP) checkpoint-and-stop then resume; every prompt's output row exists exactly once.
Deadlines: a missing GPU or too many actors fail at once, an actor that cannot be placed (at start, or to replace
a lost one) fails within place_timeout_s naming the resources; the job stays resumable.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from rich.console import Console

from specrun.cli import main
from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.jobs.attempts import read_attempts
from specrun.jobs.driver import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, RunOptions, _Interrupts, run_job
from specrun.jobs.export import finished_table
from specrun.jobs.jobdir import JobError
from specrun.jobs.modelinfo import model_info
from specrun.jobs.status import job_status, render_status
from specrun.jobs.submit import JobSettings, prepare_job
from specrun.storage.atomic import atomic_write_json, atomic_write_table
from specrun.storage.chunks import write_chunk

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


def _job(tmp_path, model, lines, every=16, device="cpu", **params):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    settings = JobSettings(device=device, checkpoint_every=every)
    job, _ = prepare_job(path, tmp_path / "job", model_info(model), settings, SamplingParams(**params), EngineConfig())
    return job


def _outputs(job) -> dict[str, dict]:
    """The finished rows; each is in outputs/*.parquet exactly once as a plain dataset (the files themselves: the
    job's reader merges by id, so it would hide a row written twice)."""
    rows = job.records.read_outputs().to_pylist()
    on_disk = [i for f in sorted(Path(str(job.records.outputs)).glob("*.parquet"))
               for i in pq.read_table(f, columns=["id"]).column("id").to_pylist()]
    assert sorted(on_disk) == sorted(r["id"] for r in rows)  # exactly once
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


def _lose_rows(job, lost: set[str]) -> None:
    """Rewrite the outputs without the rows of `lost` (as if a storage fault had eaten them)."""
    keep = [t for pid, t in job.records.iter_outputs(job.prompt_ids()) if pid not in lost]
    for f in job.records.outputs.glob("*.parquet"):
        f.unlink()
    atomic_write_table(job.records.outputs / "merged.1.0123456789abcdef.parquet", pa.concat_tables(keep))


def test_finished_prompts_leave_one_output_file_and_no_chunks_markers_or_live_files(tmp_path, model):
    job = _job(tmp_path, model, [{"id": str(i), "prompt": f"p{i}"} for i in range(5)], every=4, max_tokens=12,
               ignore_eos=True)
    assert run_job(job, QUIET).exit_code == 0
    left = sorted(str(f.relative_to(job.root)) for f in job.root.rglob("*") if f.is_file())
    assert sorted({f.split("/")[0] for f in left}) == ["attempts", "job.json", "outputs", "prompts.parquet", "state",
                                                      "timeline"], left
    assert len([f for f in left if f.startswith("outputs/")]) == 1, left
    assert list(_outputs(job)) == [str(i) for i in range(5)]
    from specrun.report.data import gather

    timelines = [f for f in left if f.startswith("timeline/")]  # the 5 prompts' timelines, merged into one file
    assert len(timelines) == 1 and timelines[0].startswith("timeline/merged."), left
    report = gather(job)
    assert [p.id for p in report.prompts] == [str(i) for i in range(5)]
    for p in report.prompts:  # the report still shows every token of every prompt once, in order
        spans = [(r["start"], r["end"]) for r in p.rows]
        assert spans[0][0] == 0 and spans[-1][1] == 12 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_corrupt_chunks_are_regenerated_and_others_left_alone(tmp_path, model):
    job = _job(tmp_path, model, [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}],
               max_tokens=120, temperature=1.0, seed=1, ignore_eos=True)
    assert run_job(job, QUIET).exit_code == 0
    ref = _outputs(job)
    # "a" lost its output row, and has checkpoints (as if interrupted) of which two are damaged: one truncated, one
    # overwritten with garbage
    _lose_rows(job, {"a"})
    for start in range(0, 96, 16):
        write_chunk(job.progress_dir("a"), start, ref["a"]["token_ids"][start:start + 16])
    chunks = sorted(job.progress_dir("a").iterdir())
    chunks[1].write_bytes(chunks[1].read_bytes()[:-30])
    chunks[3].write_bytes(b"not parquet")
    keep = int(chunks[1].name.split("-")[1])  # tokens before the first bad chunk

    assert run_job(job, QUIET).exit_code == 0
    out = _outputs(job)
    assert out["a"]["token_ids"] == ref["a"]["token_ids"]
    assert out["a"]["resumed_tokens"] == keep == 16
    assert json.loads(out["a"]["stats"])["new_tokens"] == 120 - keep
    assert out["b"] == ref["b"]  # untouched
    assert not job.progress_dir("a").exists()  # done: its chunks (and the damaged ones set aside) are gone


def test_application_error_fails_only_that_prompt(tmp_path, model):
    job = _job(tmp_path, model, [{"id": "ok", "prompt": "fine"}, {"id": "bad", "prompt": "broken"}], max_tokens=10)
    # store a prompt that validation would have refused: the engine rejects the token id
    job.create(job.manifest(), [dataclasses.replace(p, input_ids=(10**6,)) if p.id == "bad" else p
                                for p in job.prompts()])
    summary = run_job(job, QUIET)
    assert summary.exit_code == EXIT_FAILED and list(summary.failed) == ["bad"] and summary.done == ["ok"]
    assert "outside the model vocabulary" in summary.failed["bad"]
    st = {r["id"]: r for r in job_status(job)["prompts"]}
    assert st["bad"]["state"] == "failed" and "vocabulary" in st["bad"]["error"] and st["ok"]["state"] == "done"


def _reference(job, model) -> dict[str, list[int]]:
    """Uninterrupted generation of every prompt of the job, in-process (no Ray)."""
    import torch

    from specrun.decoding.engine import Engine
    from specrun.models.loader import load_model

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


def test_ctrl_c_while_ray_shuts_down_after_the_last_prompt_leaves_the_run_done(tmp_path, model, monkeypatch):
    """Every prompt finished, the workers being stopped and Ray shut down (~2 s): a Ctrl-C there is noted, not an
    interrupt of a done run."""
    import ray

    job = _job(tmp_path, model, [{"id": "a", "prompt": "first"}], every=16, max_tokens=8)
    real, seen = ray.kill, []

    def kill_under_ctrl_c(*a, **k):
        seen.append(signal.getsignal(signal.SIGINT))
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(ray, "kill", kill_under_ctrl_c)
    try:
        summary = run_job(job, QUIET)
    except KeyboardInterrupt:
        pytest.fail("a Ctrl-C while the workers stopped after the last prompt interrupted a finished run")
    assert seen and summary.exit_code == EXIT_OK and not summary.interrupted and summary.done == ["a"]
    assert "error" not in read_attempts(job)[-1]["end"]


def test_a_driver_that_loses_its_lock_checkpoints_and_stops(tmp_path, model, capsys):
    """JobLock.beat() found another driver's token in the lock (we were stalled past the lease): stop as on SIGTERM,
    and leave the lock, which is not ours any more."""
    job = _job(tmp_path, model, [{"id": "a", "prompt": "first"}], every=16, max_tokens=400, temperature=1.0, seed=3,
               ignore_eos=True)

    def lose_the_lock_after_a_checkpoint():
        while not list((job.root / "progress").glob("*/chunk-*")):
            time.sleep(0.02)
        job.lock.lost = True

    threading.Thread(target=lose_the_lock_after_a_checkpoint, daemon=True).start()
    summary = run_job(job, QUIET)
    assert summary.interrupted and summary.stopped == ["a"] and summary.exit_code == 128 + signal.SIGTERM
    assert "the job lock was lost" in capsys.readouterr().err
    assert job.lock_path.exists() and job_status(job)["prompts"][0]["tokens"] >= 16
    with pytest.raises(JobError, match="being run by another driver"):
        run_job(job, QUIET)


def test_second_ctrl_c_stops_at_once():
    with _Interrupts() as intr:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            assert signal.getsignal(s) == intr._handle
        intr._handle(signal.SIGTERM, None)
        assert intr.requested and intr.name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            intr._handle(signal.SIGINT, None)
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        assert signal.getsignal(s) != intr._handle


@pytest.mark.parametrize("how", ["SIGTERM to the driver", "SIGHUP to its process group"])
def test_sigterm_or_hangup_checkpoints_running_prompts_and_resume_is_identical(tmp_path, model, how):
    """The driver runs as `specrun resume` in a subprocess: SIGTERM (as from `timeout` or a preemption) goes to it
    alone, on the module's Ray; SIGHUP (a closed terminal) to its whole process group, its own local Ray included."""
    lines = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "second"}]
    job = _job(tmp_path, model, lines, every=32, max_tokens=400, temperature=1.0, seed=3, ignore_eos=True)
    sig = signal.SIGTERM if how.startswith("SIGTERM") else signal.SIGHUP
    address = ["--address", ray.get_runtime_context().gcs_address] if sig == signal.SIGTERM else []
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    log = tmp_path / "driver.log"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", "from specrun.cli import main; main()", "resume", str(job.root),
                          "--actors", "2", *address], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not list((job.root / "progress").glob("*/chunk-*")):
            assert time.monotonic() < deadline and p.poll() is None, "no checkpoint within 180 s"
            time.sleep(0.02)
        os.kill(p.pid, sig) if sig == signal.SIGTERM else os.killpg(p.pid, sig)
        t1 = time.monotonic()
        rc = p.wait(timeout=120)
        t2 = time.monotonic()
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # what is left of a local Ray we started
        except ProcessLookupError:
            pass
        p.wait()
    text = log.read_text()
    assert rc == 128 + sig, text
    assert f"{sig.name}: checkpointing" in text and "Resume with" in text
    assert not job.lock_path.exists()
    running = int(text.split(f"{sig.name}: checkpointing ")[1].split()[0])
    stopped_at = {r["id"]: r["tokens"] for r in job_status(job)["prompts"]}
    assert running >= 1 and sum(n > 0 for n in stopped_at.values()) >= running  # each stopped mid-way, checkpointed
    assert "worker lost" not in text and "every generated token is checkpointed" in text
    print(f"{how}: sent at {t1 - t0:.1f}s, driver exited {t2 - t1:.1f}s later with {rc}; checkpointed {stopped_at}")
    if sig == signal.SIGHUP:
        return  # resuming after a stop is the same for every signal: checked once, below

    assert run_job(job, QUIET).exit_code == 0
    out, ref = _outputs(job), _reference(job, model)
    for pid in ("a", "b"):
        assert out[pid]["token_ids"] == ref[pid]
        assert out[pid]["resumed_tokens"] >= stopped_at[pid]  # the stop flushed every token; none regenerated


def test_no_gpu_and_too_many_actors_fail_at_once_naming_the_resource(tmp_path, model):
    lines = [{"id": str(i), "prompt": "x"} for i in range(int(ray.cluster_resources()["CPU"]) + 1)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["submit", str(prompts), "--max-tokens", "4", "--device", "cuda", "--model", model,
                                  "--job-dir", str(tmp_path / "cuda"), "-q"])
    t_cuda = time.monotonic() - t0
    assert r.exit_code == 1 and "no GPU in the Ray cluster: --device cuda needs 1 GPU per actor" in r.output
    assert "cluster has 0" in r.output and "specrun resume" in r.output

    n = len(lines)
    job = _job(tmp_path / "many", model, lines, max_tokens=4)
    t0 = time.monotonic()
    with pytest.raises(JobError, match=rf"--actors {n} need\(s\) {n} CPUs \(1 per actor\), the Ray cluster "
                                       rf"has {n - 1}"):
        run_job(job, RunOptions(actors=n, quiet=True))
    t_actors = time.monotonic() - t0
    print(f"--device cuda failed in {t_cuda:.2f}s, --actors {n} in {t_actors:.2f}s")
    assert t_cuda < 30 and t_actors < 30
    assert not job.lock_path.exists() and job_status(job)["totals"]["pending"] == n


def test_an_actor_that_cannot_be_placed_fails_within_the_deadline(tmp_path, model, monkeypatch):
    """Past the up-front check (here: skipped), a GPU actor on a cluster without GPUs is never placed."""
    monkeypatch.setattr("specrun.actors.pool.resource_shortfall", lambda *a: None)
    job = _job(tmp_path, model, [{"id": "a", "prompt": "x"}], device="cuda", max_tokens=4)
    t0 = time.monotonic()
    with pytest.raises(JobError) as e:
        run_job(job, RunOptions(quiet=True, place_timeout_s=2))
    took = time.monotonic() - t0
    print(f"placement deadline of 2 s: failed after {took:.1f}s")
    assert "worker 0 could not be placed on the Ray cluster within 2 s: each needs 1 CPU and 1 GPU" in str(e.value)
    assert "0 GPU (0 free)" in str(e.value) and took < 30
    assert not job.lock_path.exists()


@pytest.mark.parametrize("driver_value", [None, "5"])
def test_workers_start_with_few_malloc_arenas(tmp_path, model, monkeypatch, driver_value):
    """A worker process starts with MALLOC_ARENA_MAX (glibc reads it only then): 2, or the driver's own value."""
    if driver_value is None:
        monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    else:
        monkeypatch.setenv("MALLOC_ARENA_MAX", driver_value)
    job = _job(tmp_path, model, [{"id": "a", "prompt": "arenas"}], max_tokens=96, ignore_eos=True)
    seen = []

    def read_worker_env():
        live = job.root / "live" / f"{job.progress_dir('a').name}.json"
        while not seen:
            try:
                environ = Path(f"/proc/{json.loads(live.read_text())['pid']}/environ").read_bytes().split(b"\0")
                seen.append(next((e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"MALLOC_ARENA_MAX=")),
                                 "unset"))
            except (OSError, ValueError, KeyError):
                time.sleep(0.01)

    reader = threading.Thread(target=read_worker_env, daemon=True)
    reader.start()
    assert run_job(job, QUIET).exit_code == 0
    reader.join(timeout=5)
    assert seen == [driver_value or "2"]


def test_a_lost_worker_whose_replacement_cannot_be_placed_fails_resumably(tmp_path, model, monkeypatch):
    """The worker process dies mid-prompt; its replacement needs a GPU the cluster lacks (as when the lost node was
    the only one with the resource): the run ends with an error naming it, and a resume finishes identically."""
    import specrun.actors.pool as pool

    real, launches = pool.start_worker, []

    def start_worker(spec, slot, gpus):
        launches.append(slot)
        return real(spec, slot, 1.0 if len(launches) > 1 else gpus)

    monkeypatch.setattr(pool, "start_worker", start_worker)
    job = _job(tmp_path, model, [{"id": "a", "prompt": "lost"}], every=16, max_tokens=160, temperature=1.0, seed=2,
               ignore_eos=True)

    def kill_worker_after_a_checkpoint():
        live = job.root / "live" / f"{job.progress_dir('a').name}.json"
        while True:
            try:
                info = json.loads(live.read_text())
                if info["checkpointed"] >= 16:
                    return os.kill(info["pid"], signal.SIGKILL)
            except (OSError, ValueError):
                pass
            time.sleep(0.02)

    threading.Thread(target=kill_worker_after_a_checkpoint, daemon=True).start()
    with pytest.raises(JobError, match="replacement for lost worker 0 could not be placed on the Ray cluster within "
                                       "8 s: each needs 1 CPU; the Ray cluster has .* 0 GPU"):
        run_job(job, RunOptions(quiet=True, place_timeout_s=8))
    assert launches == [0, 0] and not job.lock_path.exists()
    saved = job_status(job)["prompts"][0]["tokens"]
    assert saved >= 16

    monkeypatch.setattr(pool, "start_worker", real)
    assert run_job(job, QUIET).exit_code == 0
    row = _outputs(job)["a"]
    assert row["token_ids"] == _reference(job, model)["a"] and row["resumed_tokens"] >= saved


def test_done_marker_without_its_output_shows_repair_and_resume_regenerates_it(tmp_path, model):
    """The output row of a finished prompt is lost after its chunks were removed: resume regenerates it from the
    start, with the same tokens."""
    job = _job(tmp_path, model, [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}], every=8,
               max_tokens=20, ignore_eos=True)
    assert run_job(job, QUIET).exit_code == 0
    ref = _outputs(job)
    _lose_rows(job, {"a"})  # e.g. lost by a storage fault: its done marker says it was finished
    atomic_write_json(job.records.done / f"{job.progress_dir('a').name}.json", {"id": "a", "n_tokens": 20})
    status = job_status(job)
    st = {r["id"]: r for r in status["prompts"]}
    assert st["a"]["state"] == "repair" and "missing" in st["a"]["error"] and st["b"]["state"] == "done"
    screen = io.StringIO()
    render_status(status, Console(file=screen, width=150))
    assert "1 need repair" in screen.getvalue()
    table, missing = finished_table(job)
    assert table.column("id").to_pylist() == ["b"] and missing == 1

    assert not job.progress_dir("a").exists()  # its chunks went when it finished
    assert run_job(job, QUIET).exit_code == 0
    out = _outputs(job)
    assert out["a"]["token_ids"] == ref["a"]["token_ids"] and out["a"]["resumed_tokens"] == 0
    assert out["b"] == ref["b"] and job_status(job)["totals"]["done"] == 2
    assert not list(job.records.done.iterdir())


def test_concurrency_4_on_2_actors_equals_solo_also_after_sigkill_and_resume(tmp_path, model):
    """8 prompts, 4 in flight per worker (one engine step for all four): each output equals the prompt generated alone,
    also when the driver is SIGKILLed mid-job and the job resumed (resumed sequences join batches mid-run)."""
    lines = [{"id": f"p{i}", "prompt": f"prompt number {i} " * (1 + i % 3), "max_tokens": 40 + 20 * (i % 4),
              **({"temperature": 0.0} if i % 2 else {"seed": i})} for i in range(8)]
    job = _job(tmp_path, model, lines, every=8, max_tokens=60, temperature=0.9, seed=7, ignore_eos=True)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    p = subprocess.Popen([sys.executable, "-c", "from specrun.cli import main; main()", "resume", str(job.root),
                          "--actors", "2", "--concurrency", "4", "--address", ray.get_runtime_context().gcs_address,
                          "--quiet"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(list((job.root / "progress").glob("*/chunk-*"))) < 4:
            assert time.monotonic() < deadline and p.poll() is None, "no checkpoints within 180 s"
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    summary = run_job(job, RunOptions(actors=2, concurrency=4, quiet=True))
    assert summary.exit_code == 0 and len(summary.done) + len(_outputs(job)) >= 8
    out, ref = _outputs(job), _reference(job, model)
    assert sorted(out) == sorted(ref)
    for pid in ref:
        assert out[pid]["token_ids"] == ref[pid], pid
    assert any(r["resumed_tokens"] > 0 for r in out.values())  # some prompt did resume from its checkpoints
    assert [a["settings"]["concurrency"] for a in job_status(job)["attempts"]] == [4, 4]


def test_a_worker_whose_draft_must_compile_is_warmed_before_its_first_prompt(tmp_path, model, monkeypatch, capsys):
    """A worker whose load says its share of the job's tokens (2 prompts x 24 on one worker) compiles a graph (info
    "compiles": the 4-bit draft, not cached) gets no prompt until warm() returned, and the run says why it waits (and
    that the compile failed, where it did); the prompts then run as ever."""
    from specrun.actors import pool
    from specrun.actors.worker import GenerationWorker

    class Compiling(GenerationWorker):  # defined here: Ray pickles it by value into the worker process
        warmed = False

        def info(self) -> dict:
            compiles = self.engine is not None and not self.warmed and self.spec.tokens_ahead >= 48
            failed = "RuntimeError: no compiler" if self.warmed else None
            return {**super().info(), "compiles": compiles, "compile_failed": failed, "layers_failed": failed,
                    "builds": ["the layers", "the quantized self-draft"] if compiles else []}

        def warm(self) -> dict:
            time.sleep(2)  # a prompt sent before warm() returned would arrive meanwhile
            super().warm()
            self.warmed = True
            return self.info()

        def generate(self, task: dict) -> dict:
            if not self.warmed:
                raise RuntimeError("a prompt before warm() returned")
            return super().generate(task)

    monkeypatch.setattr(pool, "GenerationWorker", Compiling)
    job = _job(tmp_path, model, [{"id": "a", "prompt": "one"}, {"id": "b", "prompt": "two"}], max_tokens=24)
    assert run_job(job, RunOptions()).exit_code == EXIT_OK
    said = capsys.readouterr()
    assert "worker 0: compiling the layers and the quantized self-draft for this machine" in said.out
    assert "worker 0: the layers did not compile (RuntimeError: no compiler); they run eagerly" in said.err
    assert "worker 0: the quantized self-draft did not compile (RuntimeError: no compiler); it drafts with the eager one" \
        in said.err
    assert job_status(job)["totals"]["done"] == 2
