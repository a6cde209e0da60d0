"""A job directory on S3 (a local moto server; the endpoint in the URI, dummy credentials in the environment), end to
end through the CLI on one local Ray: submit (the driver a subprocess), a second driver refused, status while running,
the driver SIGKILLed mid-job, status, stop, resume, export, report: outputs identical to an uninterrupted local run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli import main
from tests.s3server import local_s3

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
PROMPTS = [{"id": "alpha", "prompt": "Once upon a time"}, {"id": "beta/2", "prompt": "abc abc", "max_tokens": 200}]
FLAGS = ["--max-tokens", "300", "--temperature", "1.0", "--seed", "7", "--ignore-eos", "--checkpoint-every", "16",
         "--actors", "1", "--draft", "ngram,recycling"]


@pytest.fixture(scope="module")
def s3():
    with local_s3(endpoint_env=False) as server:  # before Ray starts: its workers inherit the credentials
        yield server


@pytest.fixture(scope="module")
def local_ray(s3):
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=2)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _cli(*args) -> dict | str:
    r = CliRunner().invoke(main, [*map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) if "--json" in args else r.stdout


def _exported(path: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == len({r["id"] for r in rows}) == len(PROMPTS)  # each row exactly once
    return {r["id"]: r for r in rows}


def test_s3_job_submit_status_kill_resume_export_equals_a_local_run(s3, local_ray, tiny_models, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)  # a URI taken for a local path would show up here as a directory "s3:"
    model = tiny_models["llama_mha"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    _cli("submit", prompts, "--model", model, "--job-dir", tmp_path / "local", *FLAGS, "-q")
    _cli("export", tmp_path / "local", "-o", tmp_path / "local.jsonl")
    reference = _exported(tmp_path / "local.jsonl")

    bucket = s3.bucket()
    uri = s3.uri(bucket, "jobs/story")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    log = tmp_path / "submit.log"
    p = subprocess.Popen([sys.executable, "-c", "from specrun.cli import main; main()", "submit", str(prompts),
                          "--model", model, "--job-dir", uri, "--address", local_ray, *FLAGS], env=env,
                         stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while sum("/chunk-" in k for k in s3.keys(bucket, "jobs/story/progress/")) < 2:
            assert time.monotonic() < deadline and p.poll() is None, log.read_text()
            time.sleep(0.05)
        r = CliRunner().invoke(main, ["resume", uri])  # a second driver
        assert r.exit_code == 1 and f"being run by another driver (pid {p.pid}" in r.output, r.output
        assert _cli("status", uri, "--json")["driver"]["running"]
        os.kill(p.pid, signal.SIGKILL)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    st = _cli("status", uri, "--json")
    assert not st["driver"]["running"] and "jobs/story/lock.json" in s3.keys(bucket)  # a dead driver's lock
    saved = {r["id"]: r["tokens"] for r in st["prompts"] if r["state"] == "pending"}
    assert sum(saved.values()) >= 16 and st["totals"]["done"] < len(PROMPTS)
    r = CliRunner().invoke(main, ["stop", uri])
    assert r.exit_code == 0 and "nothing to stop" in r.output, r.output

    _cli("resume", uri, "-q")
    _cli("export", uri, "-o", tmp_path / "s3.jsonl")
    out = _exported(tmp_path / "s3.jsonl")
    for pid, ref in reference.items():
        assert out[pid]["token_ids"] == ref["token_ids"] and out[pid]["text"] == ref["text"], pid
        if saved.get(pid):  # continued from its checkpoints on S3, not from the start
            assert out[pid]["resumed_tokens"] >= saved[pid]
    st = _cli("status", uri, "--json")
    assert st["totals"]["done"] == len(PROMPTS) and not st["driver"]["running"]
    _cli("report", uri, "--no-png")  # read from the bucket, written here: ./<job name>-report.html
    assert "<html" in (tmp_path / "story-report.html").read_text()
    keys = s3.keys(bucket)
    assert "jobs/story/lock.json" not in keys and not any("/progress/" in k and ".parquet" in k for k in keys)
    assert [k for k in keys if k.startswith("jobs/story/outputs/") and k.endswith(".parquet")]
    assert sorted(os.listdir(tmp_path)) == ["local", "local.jsonl", "prompts.jsonl", "s3.jsonl", "story-report.html",
                                            "submit.log"]
