"""`specrun stop`: stop a job's driver the way Ctrl-C does (every running prompt is checkpointed, then it exits),
from any machine that sees the job directory: a detached driver through Ray Jobs, a driver on this host by SIGTERM.

Done when the driver has let go of the job (its lock is free and its Ray job, if any, has ended).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

from specrun.jobs.detach import ACTIVE, read_record, ray_job_state, stop_detached
from specrun.jobs.jobdir import JobDir, JobError

POLL_S = 0.5


@dataclass
class StopResult:
    how: str  # "ray" (detached driver), "signal" (local driver), "none" (nothing was running)
    done: bool  # the driver has let go of the job (False: still going when the wait ended)
    ray_status: str | None = None  # the Ray job's status at the end, for a detached run


def stop_job(job: JobDir, wait_s: float) -> StopResult:
    """Stop whatever runs the job, then wait up to wait_s (0: do not wait) for it to let go. JobError when the
    driver runs on another host and not detached (only that host can signal it)."""
    job.manifest()  # JobError when this is not a job
    run = read_record(job)
    ray_active = run is not None and ray_job_state(run)["status"] in ACTIVE
    if ray_active:
        stop_detached(run)
        how = "ray"
    elif job.driver_alive():
        owner = job.lock_owner() or {}
        if owner.get("host") != socket.gethostname():
            raise JobError(f"job {job.root} is run by pid {owner.get('pid')} on host {owner.get('host')}, not "
                           f"detached: stop it there (Ctrl-C, or kill -TERM {owner.get('pid')})")
        try:
            os.kill(int(owner["pid"]), signal.SIGTERM)  # the driver checkpoints its running prompts and exits (143)
        except ProcessLookupError:
            pass  # gone meanwhile
        how = "signal"
    else:
        return StopResult("none", True, ray_job_state(run)["status"] if run is not None else None)
    deadline = time.monotonic() + wait_s
    while True:
        status = ray_job_state(run)["status"] if how == "ray" else None
        done = not job.driver_alive() and status not in ACTIVE
        if done or time.monotonic() >= deadline:
            return StopResult(how, done, status)
        time.sleep(POLL_S)
