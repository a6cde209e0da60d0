"""What a run shows: the driver sends a Snapshot (snapshot.py) and log/warn lines to a view it is given; views here
print plain periodic lines or (quiet) only warnings; rich bars are rich_view.py's. make_view picks one.
"""

from __future__ import annotations

import sys
import time

from specrun.jobs.printable import printable
from specrun.jobs.snapshot import Snapshot  # also imported from here

PLAIN_EVERY_S = 10.0


class QuietView:
    """Warnings and errors only (--quiet)."""

    def log(self, msg: str) -> None:
        pass

    def warn(self, msg: str) -> None:
        print(printable(msg), file=sys.stderr, flush=True)

    def update(self, snap: Snapshot) -> None:
        pass

    def close(self) -> None:
        pass


class PlainView(QuietView):
    """For logs and pipes: messages on stdout, warnings on stderr, a progress line at most every `every_s`."""

    def __init__(self, every_s: float = PLAIN_EVERY_S):
        self.every_s, self.last = every_s, 0.0

    def log(self, msg: str) -> None:
        print(printable(msg), flush=True)

    def update(self, snap: Snapshot) -> None:
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            print(f"[{time.strftime('%H:%M:%S')}] prompts {snap.done_prompts}/{snap.total_prompts} done, "
                  f"{len(snap.running)} running; tokens {snap.tokens:,}/{snap.total_tokens:,}; "
                  f"{snap.tokens_per_s:,.0f} tok/s", flush=True)


def make_view(quiet: bool):
    """QuietView with quiet; rich bars when stdout and stderr are both a terminal; else plain lines."""
    if quiet:
        return QuietView()
    if sys.stdout.isatty() and sys.stderr.isatty():
        from specrun.jobs.rich_view import RichView

        return RichView()
    return PlainView()
