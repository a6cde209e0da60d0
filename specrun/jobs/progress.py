"""Driver-side display: rich bars on a terminal (overall tokens, prompts, one bar per active prompt), plain periodic
log lines otherwise, nothing but warnings with quiet. Fed from the workers' live files; never touches Ray.
"""

from __future__ import annotations

import sys
import time

PLAIN_EVERY_S = 10.0


class Display:
    def __init__(self, total_prompts: int, done_prompts: int, mode: str, plain_every_s: float = PLAIN_EVERY_S):
        self.mode = mode  # "rich" | "plain" | "quiet"
        self.total_prompts, self.done_prompts = total_prompts, done_prompts
        self.plain_every_s, self.last_plain = plain_every_s, 0.0
        self.t0 = time.monotonic()
        self.bars: dict[str, int] = {}
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self.progress.start()
            self.tok_task = self.progress.add_task("tokens", total=None, info="")
            self.prompt_task = self.progress.add_task("prompts", total=total_prompts, completed=done_prompts, info="")

    @staticmethod
    def choose_mode(quiet: bool) -> str:
        return "quiet" if quiet else ("rich" if sys.stdout.isatty() else "plain")

    def log(self, msg: str) -> None:
        if self.mode == "rich":
            self.progress.console.print(msg)
        elif self.mode == "plain":
            print(msg, flush=True)

    def warn(self, msg: str) -> None:
        if self.mode == "rich":
            self.progress.console.print(f"[yellow]{msg}[/yellow]")
        else:
            print(msg, file=sys.stderr, flush=True)

    def update(self, live: dict[str, dict], done_prompts: int, tokens: int, total_tokens: int) -> None:
        """live: prompt id -> live info of the prompts in flight (tokens, max_tokens, tokens_per_s, mean_accepted)."""
        self.done_prompts = done_prompts
        rate = sum(i.get("tokens_per_s", 0.0) for i in live.values())
        if self.mode == "rich":
            p = self.progress
            p.update(self.tok_task, completed=tokens, total=total_tokens, info=f"{rate:,.0f} tok/s")
            p.update(self.prompt_task, completed=done_prompts)
            for pid in [k for k in self.bars if k not in live]:
                p.remove_task(self.bars.pop(pid))
            for pid, i in live.items():
                info = f"{i.get('tokens_per_s', 0):,.0f} tok/s  {i.get('mean_accepted', 0):.2f} acc/step"
                if pid not in self.bars:
                    self.bars[pid] = p.add_task(f"  {pid[:22]}", total=i.get("max_tokens"), info=info)
                p.update(self.bars[pid], completed=i.get("tokens", 0), info=info)
        elif self.mode == "plain":
            now = time.monotonic()
            if now - self.last_plain >= self.plain_every_s:
                self.last_plain = now
                print(f"[{time.strftime('%H:%M:%S')}] prompts {done_prompts}/{self.total_prompts} done, "
                      f"{len(live)} running; tokens {tokens:,}/{total_tokens:,}; {rate:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.mode == "rich":
            self.progress.stop()
