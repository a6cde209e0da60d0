"""`specrun status --watch`: the status table shown again every interval (redrawn in place by rich Live on a terminal,
printed again otherwise) until no prompt is left to run; Ctrl-C (KeyboardInterrupt) leaves at any time.
"""

from __future__ import annotations

import contextlib
from time import sleep, strftime

from specrun.jobs.jobdir import JobDir
from specrun.jobs.status import job_status, status_renderable


def finished(st: dict) -> bool:
    """No prompt left to run: each is done or failed (failed ones only once no driver runs: a starting resume retries
    them)."""
    t = st["totals"]
    if t["pending"] or t["running"] or t["repair"]:
        return False
    return not (t["failed"] and st["driver"]["running"])


def watch(job: JobDir, console, interval_s: float) -> dict:
    """Show job_status(job) on the rich `console` every interval_s until finished(); returns the last status."""
    from rich.console import Group
    from rich.text import Text

    with contextlib.ExitStack() as stack:
        if console.is_terminal:
            from rich.live import Live

            live = stack.enter_context(Live(console=console, auto_refresh=False))

            def show(r):
                live.update(r, refresh=True)
        else:
            show = console.print
        while True:
            st = job_status(job)
            show(Group(Text(f"[{strftime('%H:%M:%S')}] every {interval_s:g} s, Ctrl-C to leave"),
                       status_renderable(st)))
            if finished(st):
                return st
            sleep(interval_s)
