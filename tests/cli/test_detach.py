"""Detached jobs against a real Ray cluster that this module starts (`ray start --head --block`, its own ports and temp
dir, a dashboard for the Jobs API): `submit --detach` returns while the job runs, and it ends with the outputs of plain
AR decoding of its prompts in one uninterrupted run; a detached job is stopped by `specrun stop` (checkpointed, Ray job
STOPPED), `status` shows its Ray job, and `resume --detach` finishes it with those same outputs. Also: --detach refused
without a reachable cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli import main
from specrun.jobs.jobdir import JobDir

pytest.importorskip("aiohttp_cors", reason="needs ray[default] (the specrun[jobs] extra): the dashboard, the Jobs API")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [{"id": "one", "prompt": "abc abc abc"}, {"id": "two", "prompt": "Once upon a time"}]
FLAGS = ["--temperature", "1.0", "--seed", "7", "--ignore-eos", "--checkpoint-every", "32", "--actors", "1", "-q"]
STOPPED_TOKENS, WHOLE_TOKENS = 1000, 100  # the stopped job must still run when `stop` comes; the other only finish
PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _wait_for(cond, timeout: float, what: str, every: float = 0.2, why=lambda: ""):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{why()}")


def _up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _jobs_api_ready(address: str) -> bool:
    """True once a no-op Ray job has run: the dashboard answers before its agent can take jobs."""
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
        rid = client.submit_job(entrypoint="true")
    except OSError:  # the dashboard dropped the connection (a busy machine)
        return False
    except RuntimeError as e:
        if "No available agent" in str(e):
            return False
        raise
    return _wait_for(lambda: str(client.get_job_status(rid).value) == "SUCCEEDED", 60, "a no-op Ray job")


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        try:
            if d.isdigit() and int(d) != sid and os.getsid(int(d)) == sid:
                pids.append(int(d))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster with a dashboard, in a session of its own: at teardown the `ray start --block` we
    started is terminated (it stops its processes), then anything left in its session is killed by pid."""
    ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS))))
    temp = tempfile.mkdtemp(prefix="srray", dir="/tmp")  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    ray_bin = shutil.which("ray", path=env["PATH"])
    cmd = [ray_bin, "start", "--head", "--block", "--num-cpus=2", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}",
           "--object-store-memory=100000000", "--disable-usage-stats", *(f"{k}={v}" for k, v in ports.items())]
    log = open(os.path.join(temp, "ray-start.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    dashboard = f"http://127.0.0.1:{ports['--dashboard-port']}"
    try:
        _wait_for(lambda: proc.poll() is not None or _up(dashboard + "/api/version"), 90, "the Ray dashboard")
        assert proc.poll() is None, open(log.name).read()
        # the dashboard's job agent can take past 90 s to take jobs beside the suite's other process (stop 80, once)
        _wait_for(lambda: _jobs_api_ready(dashboard), 240, "the Ray Jobs API")
        yield {"address": dashboard, "gcs": f"127.0.0.1:{ports['--port']}", "env": env,
               "logs": Path(temp) / "session_latest" / "logs"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def no_ray_env(monkeypatch):
    for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(k, raising=False)


def _status(job_dir) -> dict:
    r = CliRunner().invoke(main, ["status", str(job_dir), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _outputs(job_dir) -> dict[str, list[int]]:
    rows = JobDir(job_dir).records.read_outputs().to_pylist()
    assert len(rows) == len({r["id"] for r in rows}) == len(PROMPTS)
    return {r["id"]: r for r in rows}


def _driver_log(cluster, job_dir) -> str:
    """The Ray job log of the job's latest detached driver (for failure messages)."""
    rid = json.loads((Path(job_dir) / "detached.json").read_text())["ray_job_id"]
    path = cluster["logs"] / f"job-driver-{rid}.log"
    return path.read_text()[-3000:] if path.exists() else f"(no {path})"


def _detach(args: list[str], address: str) -> str:
    r = CliRunner().invoke(main, [*args, "--detach", "--address", address])
    assert r.exit_code == 0, r.output
    ray_id = r.stdout.strip()
    assert f"ray job logs -f {ray_id}" in r.stderr and "--watch" in r.stderr  # how to follow it
    return ray_id


def _finished(job_dir) -> bool:
    """The job's detached run has ended well (asserting it did not fail)."""
    st = _status(job_dir)
    assert st["detached"]["status"] not in ("FAILED", "STOPPED", "UNKNOWN"), st["detached"]
    return st["totals"]["done"] == len(PROMPTS) and st["detached"]["status"] == "SUCCEEDED"


def _reference(job_dir) -> dict[str, list[int]]:
    """The job's prompts generated in-process by the engine, as plain AR decoding in one uninterrupted run."""
    from specrun.decoding.engine import Engine, EngineConfig
    from specrun.models.loader import load_model

    job = JobDir(job_dir)
    m = job.manifest()["model"]
    engine = Engine(load_model(m["path"], dtype=m["dtype"]), EngineConfig(drafters=()))
    return {r.id: engine.generate(list(r.input_ids), r.params).token_ids for r in job.prompts()}


def test_detached_jobs_run_stop_and_resume_to_the_plain_outputs(cluster, tiny_models, tmp_path, no_ray_env):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in PROMPTS))
    submit = ["submit", str(prompts), "--model", tiny_models["llama_mha"], *FLAGS]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"

    stopped_id = _detach([*submit, "--max-tokens", str(STOPPED_TOKENS), "--job-dir", str(stopped)], cluster["address"])
    whole_id = _detach([*submit, "--max-tokens", str(WHOLE_TOKENS), "--job-dir", str(whole)], cluster["address"])
    assert _status(whole)["detached"]["status"] in ("PENDING", "RUNNING")  # submit returned while it runs
    # stop the first once it has checkpointed tokens
    _wait_for(lambda: any(stopped.glob("progress/*/chunk-*")), 300, "a checkpoint of the detached job", every=0.05,
              why=lambda: _driver_log(cluster, stopped))
    assert _status(stopped)["driver"]["running"]
    r = CliRunner().invoke(main, ["stop", str(stopped)])
    assert r.exit_code == 0 and "stopped job" in r.output, r.output
    st = _status(stopped)
    assert st["detached"]["ray_job_id"] == stopped_id and st["detached"]["status"] == "STOPPED", st["detached"]
    assert not st["driver"]["running"] and st["totals"]["done"] < len(PROMPTS)
    kept = {p["id"]: p["tokens"] for p in st["prompts"] if p["state"] == "pending"}
    assert sum(kept.values()) > 0, st["prompts"]  # checkpointed as by Ctrl-C
    assert "SIGTERM: checkpointing" in _driver_log(cluster, stopped)
    r = CliRunner().invoke(main, ["stop", str(stopped)])
    assert r.exit_code == 0 and "nothing to stop" in r.output

    resumed_id = _detach(["resume", str(stopped)], cluster["address"])
    record = json.loads((stopped / "detached.json").read_text())
    assert resumed_id != stopped_id and record["ray_job_id"] == resumed_id
    assert record["entrypoint"].startswith(f"specrun resume {stopped}")

    expected = {d: _reference(d) for d in (whole, stopped)}  # while the detached runs go on
    _wait_for(lambda: _finished(whole), 300, "the detached job to finish", every=1.0,
              why=lambda: _driver_log(cluster, whole))
    _wait_for(lambda: _finished(stopped), 300, "the resumed detached job to finish", every=1.0,
              why=lambda: _driver_log(cluster, stopped))
    assert _status(whole)["detached"]["ray_job_id"] == whole_id
    assert {pid: row["token_ids"] for pid, row in _outputs(whole).items()} == expected[whole]
    out = _outputs(stopped)
    assert {pid: row["token_ids"] for pid, row in out.items()} == expected[stopped]
    for pid, n in kept.items():  # the resumed run went on from the checkpoint
        assert out[pid]["resumed_tokens"] >= n


def test_detach_needs_a_reachable_cluster(tiny_models, tmp_path, no_ray_env):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps(PROMPTS[0]) + "\n")
    job_dir = tmp_path / "job"
    args = ["submit", str(prompts), "--model", tiny_models["llama_mha"], "--job-dir", str(job_dir), *FLAGS,
            "--max-tokens", "10"]
    r = CliRunner().invoke(main, [*args, "--detach"])
    assert r.exit_code == 2 and "--detach needs a Ray cluster" in r.output
    assert not job_dir.exists()  # refused before anything was written
    (port,) = _free_ports(1)  # nothing listens there
    r = CliRunner().invoke(main, [*args, "--detach", "--address", f"http://127.0.0.1:{port}"])
    assert r.exit_code == 1 and f"cannot reach the Ray Jobs API at 'http://127.0.0.1:{port}'" in r.output, r.output
    assert not (job_dir / "detached.json").exists()
    r = CliRunner().invoke(main, ["stop", str(job_dir)])
    assert r.exit_code == 0 and "nothing to stop" in r.output
