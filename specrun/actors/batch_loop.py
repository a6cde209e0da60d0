"""A worker's batched generation loop: concurrent generate() calls hand it requests and wait for their results.

The worker's compute thread (compute.py) owns the Engine (admission, steps, per-sequence callbacks) while requests
are in flight; callers only queue and wait, so Ray's actor threads (max_concurrency) turn into sequences of one batch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.actors.compute import ComputeThread


@dataclass
class _Request:
    key: str
    prompt: list[int]
    params: object
    resume: list[int]
    on_step: Callable[[list[int]], bool]
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None
    stats: object = None  # its GenStats, from admission on


class BatchLoop:
    def __init__(self, engine, compute: ComputeThread):
        self.engine = engine
        self._compute = compute
        self._lock = threading.Lock()  # the queues and _looping, between callers and the compute thread
        self._pending: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        self._looping = False  # the loop is queued or runs on the compute thread

    def generate(self, key: str, prompt: list[int], params, resume: list[int], on_step):
        """Blocks until this request's GenerationResult (or raises its error); on_step(emitted) -> stop?
        Returns (result, its GenStats)."""
        req = _Request(key, prompt, params, resume, on_step)
        with self._lock:
            self._pending.append(req)
            if not self._looping:
                self._looping = True
                self._compute.submit(self._run)
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result, req.stats

    def stats_of(self, key: str):
        """Counters of a running request (called from its on_step, in the loop's thread)."""
        return self._running[key].stats

    def _admit(self) -> None:
        """Queued requests join while a slot and their KV reservation are free; a bad request fails alone."""
        while self._pending:
            req = self._pending[0]
            try:
                admitted = self.engine.admit(req.key, req.prompt, req.params, req.resume)
            except Exception as e:  # noqa: BLE001 - invalid request (vocabulary, context): its caller gets the error
                self._pending.popleft()
                self._deliver(req, error=e)
                continue
            if not admitted:
                if not self._running:
                    self._pending.popleft()
                    self._deliver(req, error=ValueError(
                        f"prompt {req.key!r} needs more KV slots than the worker's pool holds "
                        f"({self.engine.batch.kv_tokens}); lower --concurrency or max_tokens"))
                    continue
                return
            req.stats = self.engine.stats_of(req.key)
            self._running[req.key] = self._pending.popleft()

    def _run(self) -> None:
        """Steps until no request is left, then gives the compute thread back (a snapshot or a load may wait)."""
        while True:
            with self._lock:
                if not self._pending and not self._running:
                    self._looping = False
                    return
                self._admit()
            if not self._running:
                continue
            try:
                finished = self.engine.step(lambda key, emitted: self._running[key].on_step(emitted))
            except BaseException as e:  # noqa: BLE001 - a failed step fails every sequence in it; the driver retries
                for key in list(self._running):
                    self.engine.drop(key)
                    self._deliver(self._running.pop(key), error=e)
                continue
            for key, result in finished:
                self._deliver(self._running.pop(key), result=result)

    @staticmethod
    def _deliver(req: _Request, result=None, error: BaseException | None = None) -> None:
        req.result, req.error = result, error
        req.done.set()
