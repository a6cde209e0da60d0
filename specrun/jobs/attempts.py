"""Attempt records: every run of a job (submit, a resubmit, resume) writes JOB/attempts/<n:04d>.json, under the job
lock, with the settings it ran with that may change between attempts without changing a token, and how it ended.

job.json stays the manifest, written once: device, drafting, checkpoint cadence, actors, Ray address and the model's
location are the job's there only as submitted; a run's own values (RunOptions, None = as submitted) are here.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time

from specrun import __version__
from specrun.jobs.jobdir import JobDir, JobError, engine_json, manifest_differences
from specrun.jobs.runopts import RunOptions, RunSummary
from specrun.storage.atomic import atomic_write_json, read_json
from specrun.storage.fs import location

_NAME = re.compile(r"^(\d{4,})\.json$")


def attempt_settings(manifest: dict, opts: RunOptions) -> dict:
    """What this run uses: opts where given, else the job's as submitted. JobError if it would change the outputs."""
    m, ck = manifest["model"], manifest["checkpoint"]
    engine = manifest["engine"] if opts.engine is None else engine_json(opts.engine)
    diffs = manifest_differences(manifest, {**manifest, "engine": engine})
    if diffs:
        raise JobError(f"this run's settings would change the job's outputs: {'; '.join(diffs)}; nothing was run")
    return {
        "device": opts.device or m["device"], "dtype": m["dtype"], "model_path": opts.model_path or m["path"],
        "engine": engine,
        "checkpoint": {"every": opts.checkpoint_every or ck["every"], "seconds": opts.checkpoint_seconds or ck["seconds"]},
        "actors": opts.actors, "gpus_per_actor": opts.gpus_per_actor, "concurrency": opts.concurrency,
        "ray_address": opts.address or os.environ.get("RAY_ADDRESS") or None,
        "hot_start": [location(h) for h in opts.hot_start],
    }


def _numbers(job: JobDir) -> list[tuple[int, str]]:
    names = job.fs.list(job.attempts_dir)
    return sorted((int(m.group(1)), n) for n in names if (m := _NAME.match(n)))


@contextlib.contextmanager
def recorded_attempt(job: JobDir, settings: dict):
    """Writes the next attempt record (the caller holds the job lock), yields it; on the way out adds how the run
    ended (`record["summary"]`, a RunSummary the caller sets, or the exception), best-effort."""
    nums = _numbers(job)
    n = nums[-1][0] + 1 if nums else 1
    path = job.attempts_dir / f"{n:04d}.json"
    record = {"attempt": n, "started_at": time.time(), "host": socket.gethostname(), "pid": os.getpid(),
              "specrun_version": __version__, "settings": settings}
    try:
        atomic_write_json(path, record)
    except OSError as e:
        raise JobError(f"cannot write the attempt record {path} ({type(e).__name__}: {e}); nothing was run") from None
    end: dict = {}
    try:
        yield end
    except BaseException as e:
        end["error"] = f"{type(e).__name__}: {e}"[:500]
        raise
    finally:
        summary: RunSummary | None = end.pop("summary", None)
        if summary is not None:
            end.update(exit_code=summary.exit_code, done=len(summary.done), failed=len(summary.failed),
                       interrupted=summary.interrupted)
        try:
            atomic_write_json(path, {**record, "ended_at": time.time(), "end": end})
        except OSError:
            pass  # the start record stands: it says what the attempt used


def read_attempts(job: JobDir) -> list[dict]:
    """Every attempt record, oldest first; one that cannot be read is {"attempt": n, "error": ...} (never raises)."""
    out = []
    for n, name in _numbers(job):
        try:
            rec = read_json(job.attempts_dir / name)
            if not isinstance(rec, dict) or not isinstance(rec.get("settings"), dict):
                raise ValueError("not an attempt record")
        except (OSError, ValueError) as e:
            rec = {"attempt": n, "error": f"attempts/{name} is unreadable ({type(e).__name__}: {str(e)[:200]})"}
        out.append(rec)
    return out


def describe(rec: dict) -> str:
    """One line: '#2 2025-01-31 10:00 on host: cpu float32, 2 actors, draft ngram,recycling, trie 64 (adaptive),
    sdpa, checkpoint every 32 tokens / 60 s'."""
    if "error" in rec and "settings" not in rec:
        return f"#{rec.get('attempt')}: {rec['error']}"
    try:
        s, e = rec["settings"], rec["settings"]["engine"]
        drafters = e.get("drafters")
        draft = "auto" if drafters is None else ",".join(drafters) or "none"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec["started_at"]))
        actors = f"{s['actors']} actor(s)" if s.get("actors") else "default actors"
        return (f"#{rec['attempt']} {when} on {rec.get('host')}: {s['device']} {s['dtype']}, {actors}, draft {draft}, "
                f"trie {e.get('trie_budget')}{' (adaptive)' if e.get('adaptive_budget') else ''}, "
                f"{e.get('attention')}{', compiled layers' if e.get('compile_layers') in (True, 'on') else ''}, "
                f"checkpoint every {s['checkpoint']['every']} tokens / "
                f"{s['checkpoint']['seconds']:g} s" + (f", Ray at {s['ray_address']}" if s.get("ray_address") else ""))
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        return f"#{rec.get('attempt')}: malformed record ({type(err).__name__}: {err})"
