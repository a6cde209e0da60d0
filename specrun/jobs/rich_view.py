"""Rich progress bars for a run on a terminal: one for the job (tokens, prompts done, tok/s, ETA) and one per running
prompt (tokens/max, tok/s, accepted tokens per step, ETA), drawn from the driver's Snapshots (progress.py).
"""

from __future__ import annotations

from specrun.jobs.printable import printable
from specrun.jobs.snapshot import Snapshot
from specrun.jobs.status import _eta


class RichView:
    """Starts drawing at its first message (a run that fails before that leaves the terminal untouched)."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console()
        self.progress = None
        self.bars: dict[str, int] = {}  # prompt id -> task id

    def _started(self):
        if self.progress is None:
            from rich.progress import BarColumn, Progress, TextColumn

            # markup off: prompt ids and paths are data, and "[...]" in them must print as it is
            self.progress = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                     *(TextColumn(f"{{task.fields[{f}]}}", justify="right", markup=False)
                                       for f in ("count", "rate", "acc", "eta")),
                                     console=self.console)
            self.progress.start()
            self.job_bar = self.progress.add_task("job", total=None, count="", rate="", acc="", eta="")
        return self.progress

    def log(self, msg: str) -> None:
        self._started().console.print(printable(msg), markup=False, highlight=False)

    def warn(self, msg: str) -> None:
        self._started().console.print(msg, style="yellow", markup=False, highlight=False)

    def update(self, snap: Snapshot) -> None:
        p = self._started()
        rate = snap.tokens_per_s
        left = max(0, snap.total_tokens - snap.tokens)
        p.update(self.job_bar, completed=snap.tokens, total=snap.total_tokens,
                 description=f"job: {snap.done_prompts}/{snap.total_prompts} prompts done",
                 count=f"{snap.tokens:,}/{snap.total_tokens:,} tokens", rate=f"{rate:,.1f} tok/s", acc="",
                 eta=f"ETA {_eta(left / rate if rate > 0 else None)}")
        for pid in [k for k in self.bars if k not in snap.running]:
            p.remove_task(self.bars.pop(pid))
        for pid, i in snap.running.items():
            tokens, most = i.get("tokens", 0), i.get("max_tokens") or 0
            r = i.get("tokens_per_s") or 0.0
            fields = {"count": f"{tokens:,}/{most:,}", "rate": f"{r:,.1f} tok/s",
                      "acc": f"{i.get('mean_accepted') or 0.0:.2f} acc/step",
                      "eta": f"ETA {_eta(max(0, most - tokens) / r if r > 0 else None)}"}
            if pid not in self.bars:
                self.bars[pid] = p.add_task(f"  {printable(pid[:20])}", total=most or None, **fields)
            p.update(self.bars[pid], completed=tokens, **fields)
        p.refresh()  # now: lines logged next are drawn above this state, not the last auto-refresh's

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
