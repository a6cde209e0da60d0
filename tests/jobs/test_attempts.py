"""Attempt records (issue 11, item 4): each run of a job records the settings it used; device, drafting, checkpoint
cadence and actors may change between runs (and are really used), the attention backend may not; outputs equal an
uninterrupted run. One local Ray for the module; runs go through the CLI in-process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import pytest
from click.testing import CliRunner
from rich.console import Console

from specrun.cli import main
from specrun.jobs.attempts import describe, read_attempts
from specrun.jobs.jobdir import JobDir, manifest_differences
from specrun.jobs.status import job_status, render_status
from specrun.storage.chunks import _NAME

ray = pytest.importorskip("ray")
LINES = [{"id": "a", "prompt": "first"}, {"id": "b", "prompt": "second one"}, {"id": "c", "prompt": "3"}]
# long enough that a run interrupted at its first checkpoint is still generating when the stop reaches the workers
# (at 120 tokens a run once finished every prompt first and exited 0)
SAMPLING = ["--max-tokens", "400", "--temperature", "1.0", "--seed", "9", "--ignore-eos", "--dtype", "float32"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=max(2, os.cpu_count() or 1))
    yield
    ray.shutdown()


def _interrupt_when(cond) -> threading.Thread:
    """Ctrl-C this process (the driver: it checkpoints and stops) once cond() holds."""
    def run():
        while not cond():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _spans(job: JobDir) -> list[int]:
    return [int(m.group(2)) - int(m.group(1)) for f in (job.root / "progress").glob("*/*")
            if (m := _NAME.match(f.name))]


def _reference(job: JobDir, model: str) -> dict[str, list[int]]:
    import torch

    from specrun.decoding.engine import Engine
    from specrun.models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(load_model(model))
        return {p.id: engine.generate(list(p.input_ids), p.params).token_ids for p in job.prompts()}
    finally:
        torch.set_num_threads(threads)


def test_runs_may_change_actors_drafting_and_cadence_each_is_recorded_and_outputs_are_identical(tmp_path,
                                                                                              tiny_models):
    model = tiny_models["llama_mha"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    job = JobDir(tmp_path / "job")
    run = CliRunner()

    # 1: submitted with n-gram + recycling drafting, 16-token checkpoints, default actors; Ctrl-C after a checkpoint
    _interrupt_when(lambda: 16 in _spans(job))
    r = run.invoke(main, ["submit", str(prompts), "--model", model, "--job-dir", str(job.root), *SAMPLING,
                          "--checkpoint-every", "16", "--draft", "ngram,recycling", "-q"])
    assert r.exit_code == 130, r.output
    # 2: resumed on 2 actors, without drafting (nor compiling a draft), 40-token checkpoints; Ctrl-C once a 40-token
    # chunk exists (the new cadence is the one used)
    _interrupt_when(lambda: 40 in _spans(job))
    r = run.invoke(main, ["resume", str(job.root), "--actors", "2", "--draft", "none", "--checkpoint-every", "40",
                          "--compile-draft", "off", "--compile-layers", "off", "-q"])
    assert r.exit_code == 130, r.output
    # the attention backend is part of what the outputs are: refused, by resume and by a resubmit, nothing recorded
    for args, why in ((["resume", str(job.root), "--attention", "split"], "engine.attention: job has 'sdpa', now 'split'"),
                      (["submit", str(prompts), "--model", model, "--job-dir", str(job.root), *SAMPLING, "--attention",
                        "split"], "engine.attention: job has 'sdpa', now 'split'")):
        r = run.invoke(main, args)
        assert r.exit_code == 1 and why in r.output, r.output
    assert len(read_attempts(job)) == 2
    # 3: resumed with no flags: the job's settings as submitted
    r = run.invoke(main, ["resume", str(job.root), "-q"])
    assert r.exit_code == 0, r.output

    rows = job.records.read_outputs().to_pylist()
    assert sorted(r["id"] for r in rows) == ["a", "b", "c"]  # one row each
    ref = _reference(job, model)
    for row in rows:
        assert row["token_ids"] == ref[row["id"]], row["id"]
    assert sum(row["resumed_tokens"] for row in rows) >= 16 + 40  # two runs' checkpoints were resumed, not redone

    st = json.loads(run.invoke(main, ["status", str(job.root), "--json"]).stdout)
    att = st["attempts"]
    assert [a["attempt"] for a in att] == [1, 2, 3] and [a["end"]["exit_code"] for a in att] == [130, 130, 0]
    s1, s2, s3 = (a["settings"] for a in att)
    assert _differences(s1, s2) == {"actors": (None, 2), "checkpoint.every": (16, 40),
                                    "engine.drafters": (["ngram", "recycling"], []),
                                    "engine.compile_draft": ("auto", "off"), "engine.compile_layers": ("auto", "off")}
    assert s3 == s1 and s1["device"] == "cpu" and s1["dtype"] == "float32" and s1["engine"]["attention"] == "sdpa"
    assert s1["ray_address"] is None and s1["checkpoint"]["seconds"] == 60.0 and s1["engine"]["trie_budget"] == 64
    assert all(a["host"] and a["specrun_version"] and a["ended_at"] >= a["started_at"] for a in att)
    screen = io.StringIO()
    render_status(job_status(job), Console(file=screen, width=300))
    table = screen.getvalue()
    assert "3 run(s); last: #3 " in table and "draft ngram,recycling" in table and "checkpoint every 16 tokens" in table


def _differences(a: dict, b: dict, prefix: str = "") -> dict:
    out = {}
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.update(_differences(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out[prefix + k] = (va, vb)
    return out


def test_a_manifest_older_than_the_attention_switch_counts_as_sdpa():
    old = {"params": {}, "engine": {"drafters": None}}
    assert manifest_differences(old, {"params": {}, "engine": {"attention": "sdpa"}}) == []
    assert manifest_differences(old, {"params": {}, "engine": {"attention": "split"}}) == [
        "engine.attention: job has 'sdpa', now 'split'"]


def test_compiled_layers_may_change_on_resume_and_a_compiled_run_says_so():
    """Not an output setting (they run only where a token is defined up to a near tie), manifests written before auto
    (a bool) included."""
    old = {"params": {}, "engine": {"drafters": None, "compile_layers": False}}
    for now in (False, True, "auto", "on", "off"):
        assert manifest_differences(old, {"params": {}, "engine": {"compile_layers": now}}) == []
    rec = {"attempt": 1, "started_at": 0, "host": "h", "settings": {
        "device": "cpu", "dtype": "float32", "actors": None, "checkpoint": {"every": 64, "seconds": 60},
        "engine": {"drafters": None, "trie_budget": 64, "adaptive_budget": True, "attention": "sdpa"}}}
    assert "compiled" not in describe(rec)
    rec["settings"]["engine"]["compile_layers"] = "auto"  # whether they compiled is the engine's to decide
    assert "compiled" not in describe(rec)
    for on in (True, "on"):
        rec["settings"]["engine"]["compile_layers"] = on
        assert "sdpa, compiled layers, checkpoint every 64 tokens" in describe(rec)


def test_a_manifest_with_compile_layers_as_a_bool_resumes_as_on_or_off_and_flags_that_contradict_are_refused(tmp_path):
    from specrun.actors.worker import engine_config

    assert engine_config({"compile_layers": True}).compile_layers == "on"
    assert engine_config({"compile_layers": False}).compile_layers == "off"
    assert engine_config({}).compile_layers == "auto"
    r = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--model", "demo", "--max-tokens", "2", "--compile",
                                  "--compile-layers", "off"])
    assert r.exit_code == 2 and "--compile compiles the layers: it contradicts --compile-layers off" in r.output


def test_a_manifest_from_before_the_width_limits_resumes_within_them():
    """A job made with --trie-budget 2048 or a huge --tree (taken before the limits) still resumes: both are speed
    settings, so they are brought within the limits rather than refused at every worker's load."""
    from specrun.actors.worker import engine_config
    from specrun.decoding.config import MAX_TRIE_BUDGET

    old = engine_config({"trie_budget": 2048, "tree": [100, 100, 100], "drafters": ["ngram"], "kv_budget": 4096})
    assert old.trie_budget == MAX_TRIE_BUDGET and old.tree == (1, 3, 3, 3) and old.drafters == ("ngram",)
    assert engine_config({"trie_budget": 48, "tree": [1, 2, 2]}).tree == (1, 2, 2)


def test_unreadable_attempt_records_are_reported_not_raised(tmp_path):
    job = JobDir(tmp_path)
    job.attempts_dir.mkdir()
    (job.attempts_dir / "0001.json").write_bytes(b'{"attempt": 1, "sett')
    (job.attempts_dir / "0002.json").write_bytes(b"\xff\xfe")
    (job.attempts_dir / "notes.txt").write_text("ignored")
    got = read_attempts(job)
    assert [a["attempt"] for a in got] == [1, 2]
    assert all("is unreadable" in a["error"] and f"attempts/000{a['attempt']}.json" in a["error"] for a in got)
