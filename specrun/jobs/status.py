"""`specrun status`: per-prompt state (pending, running, done, failed, repair), tokens, tok/s, acceptance, ETA, totals.

Read-only and safe from any terminal during or after a run. Cost: one listing of done/, failed/, live/ and progress/,
the output files read one row group at a time (a row is done only when it matches its checksum, so token ids and
text are read), and a file read only for prompts that have a failed or live file or progress chunks.
"""

from __future__ import annotations

import time

from specrun.jobs.attempts import describe, read_attempts
from specrun.jobs.detach import describe_detached, detached_status
from specrun.jobs.jobdir import JobDir
from specrun.storage.atomic import read_json
from specrun.storage.fs import fs_of
from specrun.storage.names import id_key
from specrun.storage.outputs import is_foreign

LIVE_FRESH_S = 120.0  # a live file older than this (or with no driver) is an interrupted run, not a running one
OUT_COLUMNS = ["id", "n_tokens", "finish_reason", "tokens_per_s", "mean_accepted", "seconds"]
# "repair": marked done but its output row is missing or unreadable (resume generates it again)
STATES = ("pending", "running", "done", "failed", "repair")


def _names(d) -> set[str]:
    return set(fs_of(d).list(d))


def _read(path) -> dict | None:
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


def job_status(job: JobDir) -> dict:
    manifest = job.manifest()
    owner = job.lock_owner()
    driver_up = job.driver_alive()
    rec = job.records
    prompts, _ = job.prompt_infos()
    # listed before the outputs are read: a marker seen here had its row durable before, so the scan finds it
    markers, failed, live = (_names(d) for d in (rec.done, rec.failed, rec.live))
    checkpointed = rec.checkpointed()
    scan = rec.scan([p.id for p in prompts], OUT_COLUMNS, verify=True)
    outputs = scan.rows
    rows = []
    now = time.time()
    for p in prompts:
        key = id_key(p.id)
        row = {"id": p.id, "line": p.line, "max_tokens": p.params.max_tokens, "tokens": 0, "tokens_per_s": None,
               "mean_accepted": None, "eta_s": None, "finish_reason": None, "error": None}
        if (o := outputs.get(p.id)) is not None:
            row.update(state="done", tokens=o["n_tokens"], tokens_per_s=o["tokens_per_s"],
                       mean_accepted=o["mean_accepted"], finish_reason=o["finish_reason"], eta_s=0.0)
        elif p.id in scan.damaged:
            row.update(state="repair", tokens=checkpointed(p.id), error="its output row does not match its checksum (damaged); "
                                                             "`specrun resume` generates it again")
        elif f"{key}.json" in markers:  # a done marker without a readable output row: resume regenerates it
            row.update(state="repair", tokens=checkpointed(p.id),
                       error=f"{rec.output_problem(p.id)}; `specrun resume` generates it again")
        elif f"{key}.json" in failed and (f := _read(rec.failed / f"{key}.json")) is not None:
            row.update(state="failed", error=f.get("error"), tokens=checkpointed(p.id))
        else:
            info = _read(rec.live / f"{key}.json") if f"{key}.json" in live else None
            if info and driver_up and now - info.get("updated_at", 0) < LIVE_FRESH_S:
                rate = info.get("tokens_per_s") or 0.0
                left = max(0, p.params.max_tokens - info.get("tokens", 0))
                row.update(state="running", tokens=info.get("tokens", 0), tokens_per_s=rate,
                           mean_accepted=info.get("mean_accepted"), eta_s=left / rate if rate > 0 else None,
                           worker=f"{info.get('host', '?')}/{info.get('slot', '?')}")
            else:
                row.update(state="pending", tokens=checkpointed(p.id))
        rows.append(row)
    counts = {s: 0 for s in STATES}
    for r in rows:
        counts[r["state"]] += 1
    running_rate = sum(r["tokens_per_s"] or 0 for r in rows if r["state"] == "running")
    workers: dict[str, dict] = {}  # host/slot -> prompts it runs now and their summed tok/s (--concurrency > 1)
    for r in rows:
        if r["state"] == "running":
            w = workers.setdefault(r["worker"], {"running": 0, "tokens_per_s": 0.0})
            w["running"] += 1
            w["tokens_per_s"] += r["tokens_per_s"] or 0.0
    left = sum(max(0, r["max_tokens"] - r["tokens"]) for r in rows if r["state"] in ("pending", "running", "repair"))
    return {
        "job": str(job.root), "model": manifest["model"]["path"],
        "driver": {"running": driver_up, **({"pid": owner.get("pid"), "host": owner.get("host")} if owner else {})},
        "prompts": rows,
        "totals": {**counts, "total": len(rows), "tokens": sum(r["tokens"] for r in rows),
                   "tokens_per_s": running_rate, "eta_s": left / running_rate if running_rate > 0 else None},
        "workers": workers,
        # output files (or row groups) that could not be read: the prompts they held show pending until a resume
        "problems": [p for p in scan.problems if not is_foreign(p)],
        "attempts": read_attempts(job),  # what each run (submit, resume) used, oldest first
        "detached": detached_status(job),  # the latest `--detach` run and its Ray job's status, None if none
    }


def render_status(st: dict, console) -> None:
    """Pretty table of job_status() on a rich Console."""
    console.print(status_renderable(st))


def status_renderable(st: dict):
    """job_status() as one rich renderable: the table and the lines under it (totals, runs)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from specrun.jobs.printable import printable

    def cell(x) -> Text:  # ids, paths and errors are data: "[...]" in them prints as it is, control characters escaped
        return Text(printable(x))

    t = Table(title=cell(f"{st['job']}  ({'driver running' if st['driver']['running'] else 'no driver running'})"))
    for col in ("id", "state", "tokens", "tok/s", "acc/step", "ETA", "note"):
        t.add_column(col, justify="right" if col in ("tokens", "tok/s", "acc/step", "ETA") else "left")
    for r in st["prompts"]:
        note = r["finish_reason"] or (r["error"] or "")[:60]
        t.add_row(cell(r["id"]), r["state"], f"{r['tokens']:,}/{r['max_tokens']:,}", _num(r["tokens_per_s"], 1),
                  _num(r["mean_accepted"], 2), _eta(r["eta_s"]), cell(note))
    tot = st["totals"]
    lines = [t, Text(f"{tot['done']}/{tot['total']} done, {tot['running']} running, {tot['pending']} pending, "
                     f"{tot['failed']} failed" + (f", {tot['repair']} need repair (resume)" if tot["repair"] else "")
                     + f"; {tot['tokens']:,} tokens; {tot['tokens_per_s']:.1f} tok/s; ETA {_eta(tot['eta_s'])}")]
    for problem in st.get("problems", ()):
        lines.append(cell(f"warning: outputs: {problem}; `specrun resume` generates the prompts it held again"))
    if st.get("workers"):
        lines.append(cell("workers: " + "; ".join(f"{w} {v['running']} running, {v['tokens_per_s']:.1f} tok/s"
                                                  for w, v in sorted(st["workers"].items()))))
    if st["attempts"]:
        lines.append(cell(f"{len(st['attempts'])} run(s); last: {describe(st['attempts'][-1])}"))
    if st.get("detached"):
        lines.append(cell(describe_detached(st["detached"])))
    return Group(*lines)


def _num(x, digits: int) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _eta(s) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
