"""`specrun status`: per-prompt state (pending, running, done, failed, repair), tokens, tok/s, acceptance, ETA, totals.

Read-only and safe from any terminal during or after a run: it reads markers, outputs, chunk names and live files.
"""

from __future__ import annotations

import time

import pyarrow.parquet as pq

from specrun.jobs.jobdir import JobDir
from specrun.storage.chunks import progress_count
from specrun.storage.schemas import OUTPUT

LIVE_FRESH_S = 120.0  # a live file older than this (or with no driver) is an interrupted run, not a running one
OUT_COLUMNS = ["id", "n_tokens", "finish_reason", "tokens_per_s", "mean_accepted", "seconds"]
# "repair": marked done but its output file is missing or unreadable (resume regenerates it from its checkpoints)
STATES = ("pending", "running", "done", "failed", "repair")


def _output_summary(path, prompt_id: str) -> dict | None:
    try:
        rows = pq.read_table(path, columns=OUT_COLUMNS, schema=OUTPUT).to_pylist()
    except Exception:  # missing, truncated, not Parquet, I/O error
        return None
    return rows[0] if len(rows) == 1 and rows[0]["id"] == prompt_id else None


def job_status(job: JobDir) -> dict:
    manifest = job.manifest()
    owner = job.lock_owner()
    driver_up = job.driver_alive()
    rows = []
    for p in job.prompts():
        rec = job.records
        row = {"id": p.id, "line": p.line, "max_tokens": p.params.max_tokens, "tokens": 0, "tokens_per_s": None,
               "mean_accepted": None, "eta_s": None, "finish_reason": None, "error": None}
        if rec.is_done(p.id) and (o := _output_summary(rec.output_path(p.id), p.id)) is not None:
            row.update(state="done", tokens=o["n_tokens"], tokens_per_s=o["tokens_per_s"],
                       mean_accepted=o["mean_accepted"], finish_reason=o["finish_reason"], eta_s=0.0)
        elif rec.is_done(p.id):  # a done marker without a readable output row: resume regenerates the prompt
            row.update(state="repair", tokens=progress_count(job.progress_dir(p.id)),
                       error=f"{rec.output_problem(p.id) or 'output unreadable'}; `specrun resume` regenerates it")
        elif (f := rec.failure(p.id)) is not None:
            row.update(state="failed", error=f.get("error"), tokens=progress_count(job.progress_dir(p.id)))
        else:
            live = rec.read_live(p.id)
            if live and driver_up and time.time() - live.get("updated_at", 0) < LIVE_FRESH_S:
                rate = live.get("tokens_per_s") or 0.0
                left = max(0, p.params.max_tokens - live.get("tokens", 0))
                row.update(state="running", tokens=live.get("tokens", 0), tokens_per_s=rate,
                           mean_accepted=live.get("mean_accepted"), eta_s=left / rate if rate > 0 else None)
            else:
                row.update(state="pending", tokens=progress_count(job.progress_dir(p.id)))
        rows.append(row)
    counts = {s: sum(r["state"] == s for r in rows) for s in STATES}
    running_rate = sum(r["tokens_per_s"] or 0 for r in rows if r["state"] == "running")
    left = sum(max(0, r["max_tokens"] - r["tokens"]) for r in rows if r["state"] in ("pending", "running", "repair"))
    return {
        "job": str(job.root), "model": manifest["model"]["path"],
        "driver": {"running": driver_up, **({"pid": owner.get("pid"), "host": owner.get("host")} if owner else {})},
        "prompts": rows,
        "totals": {**counts, "total": len(rows), "tokens": sum(r["tokens"] for r in rows),
                   "tokens_per_s": running_rate, "eta_s": left / running_rate if running_rate > 0 else None},
    }


def render_status(st: dict, console) -> None:
    """Pretty table of job_status() on a rich Console."""
    from rich.table import Table

    t = Table(title=f"{st['job']}  ({'driver running' if st['driver']['running'] else 'no driver running'})")
    for col in ("id", "state", "tokens", "tok/s", "acc/step", "ETA", "note"):
        t.add_column(col, justify="right" if col in ("tokens", "tok/s", "acc/step", "ETA") else "left")
    for r in st["prompts"]:
        note = r["finish_reason"] or (r["error"] or "")[:60]
        t.add_row(r["id"], r["state"], f"{r['tokens']:,}/{r['max_tokens']:,}", _num(r["tokens_per_s"], 1),
                  _num(r["mean_accepted"], 2), _eta(r["eta_s"]), note)
    console.print(t)
    tot = st["totals"]
    console.print(f"{tot['done']}/{tot['total']} done, {tot['running']} running, {tot['pending']} pending, "
                  f"{tot['failed']} failed" + (f", {tot['repair']} need repair (resume)" if tot["repair"] else "")
                  + f"; {tot['tokens']:,} tokens; {tot['tokens_per_s']:.1f} tok/s; "
                  f"ETA {_eta(tot['eta_s'])}")


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _eta(s) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
