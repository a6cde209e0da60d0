"""Driver helpers for stopping cleanly: the signal handler (SIGINT, SIGTERM, SIGHUP: first one checkpoints and
stops, a second one stops at once) and a progress-view wrapper that survives a terminal that is gone.
"""

from __future__ import annotations

import signal
import threading


class _Interrupts:
    """The first SIGINT, SIGTERM or SIGHUP sets `requested` (checkpoint running prompts, then stop); a second one
    raises KeyboardInterrupt (stop now). Only in the main thread; the previous handlers (Ray's) come back on exit."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        self.old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.signum = True, signum

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum in (None, signal.SIGINT) else signal.Signals(self.signum).name

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)
        self.old = {}


class stop_on_signals:
    """with stop_on_signals() as stopped: SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does, so that one
    arriving before the driver's own handler is up (imports, the prompt scan, ray.init) takes the clean path: lock
    released, the run recorded, one line. `stopped.signum` says which signal it was. Main thread only; the previous
    handlers come back on exit."""

    def __init__(self):
        self.signum = signal.SIGINT
        self.old: dict = {}

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    def _handle(self, signum, frame):
        self.signum = signum
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in _Interrupts.SIGNALS:
                self.old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, handler in self.old.items():
            signal.signal(s, handler)
        self.old = {}


class _SafeDisplay:
    """A progress view (progress.py), with output errors ignored: after SIGHUP the terminal is gone, and a failed
    write to it must not keep the running prompts from being checkpointed."""

    def __init__(self, view):
        self._d = view

    def __getattr__(self, name):
        attr = getattr(self._d, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except OSError:
                return None
        return call
