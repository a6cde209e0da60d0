"""Detached runs: the driver runs as a Ray Job (`specrun resume JOB`, submitted with JobSubmissionClient) and is
recorded in JOB/detached.json (Ray job id, dashboard address; rewritten atomically by each detached run).

The job is prepared where `submit --detach` runs (every bad line refused there, a pipe works); the cluster needs only
the job directory (the same path or object-store URI), the model and specrun itself. Needs `ray[default]` (the `specrun[jobs]` extra).
Token-authenticated clusters follow Ray's own settings (RAY_AUTH_MODE=token with RAY_AUTH_TOKEN or ~/.ray/auth_token).
"""

from __future__ import annotations

import re
import shlex
import socket
import time
import uuid
from dataclasses import dataclass

from specrun.jobs.jobdir import JobDir, JobError
from specrun.jobs.runopts import RunOptions
from specrun.storage.atomic import atomic_write_json, read_json
from specrun.storage.fs import location

RECORD = "detached.json"
PIP_HINT = 'pip install "specrun[jobs]"  (or: pip install "ray[default]" at your Ray version)'
PROBE_S = 3.0  # the dashboard must accept a connection within this (a request to a silent host waits minutes)
# Ray sends SIGTERM on stop and SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default): give the driver the time
# it takes to checkpoint every running prompt (RunOptions.stop_timeout_s) and let go of the job
STOP_GRACE_S = int(RunOptions().stop_timeout_s) + 30
ACTIVE = ("PENDING", "RUNNING")


@dataclass(frozen=True)
class DetachedRun:
    ray_job_id: str
    address: str  # the dashboard (Jobs API) URL, http://host:8265
    submitted_at: float
    submitted_from: str
    entrypoint: str


def record_path(job: JobDir):
    return job.root / RECORD


def read_record(job: JobDir) -> DetachedRun | None:
    """The latest detached run of the job, None if it never ran detached; JobError naming a damaged record."""
    path = record_path(job)
    try:
        d = read_json(path)
        return DetachedRun(**{k: d[k] for k in DetachedRun.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise JobError(f"{path} (the record of the job's detached run) is unreadable ({type(e).__name__}: {e}); "
                       f"delete it if no detached driver runs this job") from None


def _client(address: str):
    """A JobSubmissionClient for `address`; JobError naming the address (or the pip command) when that fails."""
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError as e:
        raise JobError(f"detached jobs need Ray's job submission client ({e}); install it: {PIP_HINT}") from None
    from specrun.actors.pool import _probe

    try:
        _probe(address, PROBE_S)
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError) as e:  # RuntimeError: no ray[default], or a cluster Ray refuses
        hint = f"; install it: {PIP_HINT}" if "ray[default]" in str(e) else ""
        raise JobError(f"cannot reach the Ray Jobs API at {address!r}: {e}{hint}") from None
    except Exception as e:  # AuthenticationError and what requests raises: Ray's own message says what to set
        raise JobError(f"cannot use the Ray Jobs API at {address!r}: {type(e).__name__}: {e}") from None


def _submission_id(job: JobDir) -> str:
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", location(job.root).rstrip("/").rsplit("/", 1)[-1])[:40].strip("-") or "job"
    return f"specrun-{name}-{uuid.uuid4().hex[:8]}"


def submit_detached(job: JobDir, address: str, args: list[str]) -> DetachedRun:
    """Submit `args` (the job's driver: `specrun resume JOB ...`, paths absolute) as a Ray Job to the cluster whose
    Jobs API is at `address`, and record it; JobError when it cannot be. The command gets no --address: inside a Ray
    Job, RAY_ADDRESS names the cluster."""
    if job.driver_alive():
        o = job.lock_owner() or {}
        raise JobError(f"job {job.root} is already being run (pid {o.get('pid')} on {o.get('host')}); "
                       f"`specrun stop {job.root}` stops it")
    prev = read_record(job)
    if prev is not None:
        state = ray_job_state(prev)
        if state["status"] in ACTIVE:
            raise JobError(f"job {job.root} already has a detached driver, Ray job {prev.ray_job_id} "
                           f"({state['status']}); `specrun stop {job.root}` stops it")
    client = _client(address)
    cmd = shlex.join(args)
    try:
        rid = client.submit_job(entrypoint=cmd, submission_id=_submission_id(job),
                                runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S)}},
                                metadata={"specrun_job": location(job.root)})
    except Exception as e:  # the Jobs API answered with an error: say which
        raise JobError(f"Ray at {address!r} refused the job: {type(e).__name__}: {e}") from None
    run = DetachedRun(rid, client.get_address(), time.time(), socket.gethostname(), cmd)
    atomic_write_json(record_path(job), run.__dict__)
    return run


def ray_job_state(run: DetachedRun) -> dict:
    """{"status": PENDING|RUNNING|STOPPED|SUCCEEDED|FAILED, "message", "driver_exit_code"}; status UNKNOWN with
    "error" when the Jobs API cannot be asked (unreachable dashboard, no ray[default], job not found)."""
    try:
        info = _client(run.address).get_job_info(run.ray_job_id)
    except JobError as e:
        return {"status": "UNKNOWN", "error": str(e)}
    except Exception as e:  # e.g. the head was restarted and no longer knows the job
        return {"status": "UNKNOWN", "error": f"Ray job {run.ray_job_id} at {run.address}: {type(e).__name__}: {e}"}
    return {"status": str(getattr(info.status, "value", info.status)), "message": info.message,
            "driver_exit_code": info.driver_exit_code}


def detached_status(job: JobDir) -> dict | None:
    """For `specrun status`: the latest detached run and its Ray job state, or None if the job never ran detached."""
    try:
        run = read_record(job)
    except JobError as e:
        return {"status": "UNKNOWN", "error": str(e)}
    if run is None:
        return None
    return {"ray_job_id": run.ray_job_id, "address": run.address, "submitted_at": run.submitted_at,
            **ray_job_state(run)}


def describe_detached(d: dict) -> str:
    """One line for the status table: the detached driver's Ray job and its state."""
    if "ray_job_id" not in d:
        return f"detached run: {d.get('error')}"
    running = "runs detached" if d["status"] in ACTIVE else "last ran detached"
    why = d.get("error") or (d.get("message") if d["status"] == "FAILED" else None)
    return (f"driver {running}: Ray job {d['ray_job_id']} {d['status']} at {d['address']}"
            + (f" ({why})" if why else "") + f"; logs: ray job logs {d['ray_job_id']} --address {d['address']}")


def stop_detached(run: DetachedRun) -> None:
    """Ask Ray to stop the job: SIGTERM to the driver (which checkpoints and exits), SIGKILL after STOP_GRACE_S."""
    client = _client(run.address)
    try:
        client.stop_job(run.ray_job_id)
    except Exception as e:
        raise JobError(f"Ray at {run.address!r} could not stop job {run.ray_job_id}: {type(e).__name__}: {e}") from None
