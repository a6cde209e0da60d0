"""The one thread a worker runs all its torch work on: loading, every generation step, matrix snapshots.

OpenMP (libgomp, torch's and our kernels') keeps a pool of helper threads per thread that starts parallel work; once
pooled threads outnumber the CPUs, idle helpers sleep between parallel regions instead of spinning, and each step pays
their wake-ups (a worker that loaded in one Ray actor thread and generated in another: docs/benchmarks.md, stop 53).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor


class ComputeThread:
    def __init__(self, name: str = "specrun-compute"):
        self._ident: int | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=self._mark)

    def _mark(self) -> None:
        self._ident = threading.get_ident()

    def on_it(self) -> bool:
        """Whether the caller runs on the compute thread."""
        return threading.get_ident() == self._ident

    def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the compute thread, waiting for it (at once when called from it); its result, or its
        exception raised here."""
        if self.on_it():
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()

    def submit(self, fn, *args, **kwargs) -> Future:
        """fn queued on the compute thread after the work before it; the caller does not wait."""
        return self._pool.submit(fn, *args, **kwargs)
