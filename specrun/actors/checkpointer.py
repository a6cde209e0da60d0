"""A prompt's checkpoints in a worker: its tokens in chunks every checkpoint_every tokens or checkpoint_seconds, its
timeline rows and live status; every write best-effort (a failed one is retried at the next checkpoint).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

from specrun.actors.heap import trim_heap
from specrun.decoding.stats import rss_mb
from specrun.storage.chunks import write_chunk
from specrun.storage.names import id_key
from specrun.storage.timeline import TimelineLog, chunk_row, timeline_path

LIVE_EVERY_S = 1.0
log = logging.getLogger(__name__)


class Checkpointer:
    """on_step callback: appends a chunk every checkpoint_every tokens or checkpoint_seconds; writes live status after
    each checkpoint and otherwise once per LIVE_EVERY_S. Every write is best-effort: a failed chunk keeps its tokens
    in the buffer for the next checkpoint (checkpoint_every tokens or checkpoint_seconds later, not every step).
    Each chunk written, and the tokens after the last one, get a timeline row (storage/timeline.py) from the engine's
    counters."""

    def __init__(self, worker, prompt_id: str, resumed: int, max_tokens: int):
        self.w, self.id, self.max_tokens = worker, prompt_id, max_tokens
        self.progress = worker.root / "progress" / id_key(prompt_id)
        self.start = resumed  # first generated-token offset not yet in a chunk
        self.resumed = resumed
        self.buf: list[int] = []
        self.due = worker.spec.checkpoint_every  # buffer length that triggers the next chunk write
        self.steps = 0
        self.t0 = self.last_ckpt = time.monotonic()
        self.last_live = 0.0
        self.failures: dict[str, list] = {}  # what -> [count, last error]
        self.timeline = TimelineLog(timeline_path(worker.root, prompt_id), resumed)
        self.row_at, self.row_stats = self.t0, {}  # where the next timeline row starts: clock, engine counters
        self.stats = None  # () -> this generation's GenStats (set by the worker: its engine or its batch loop)
        self.disk_full: str | None = None  # the first write refused for lack of space
        self._live(time.monotonic(), force=True)

    def __call__(self, emitted: list[int]) -> bool:
        self.buf.extend(emitted)
        self.steps += 1
        now = time.monotonic()
        checkpoint = len(self.buf) >= self.due or (
            bool(self.buf) and now - self.last_ckpt >= self.w.spec.checkpoint_seconds)
        if checkpoint:
            if not self._write(self.buf):
                self.due = len(self.buf) + self.w.spec.checkpoint_every
            self.snapshot()
            self.last_ckpt = now
        self._live(now, force=checkpoint)  # a checkpoint is news: status shows it at once
        # a full disk stops this generation at once: what it would generate next could not be checkpointed either
        return self.w.stop.is_set() or self.disk_full is not None

    def best_effort(self, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except OSError as e:
            if what == "checkpoint" and e.errno in (errno.ENOSPC, errno.EDQUOT) and self.disk_full is None:
                # no room for the tokens themselves: this generation stops (a stats file failing is only retried)
                self.disk_full = f"{e.filename or self.progress}: {e.strerror or e}"
            f = self.failures.setdefault(what, [0, ""])
            f[0] += 1
            f[1] = f"{type(e).__name__}: {e}"
            log.warning("prompt %r: %s write failed (%s); retrying at the next checkpoint", self.id, what, f[1])
            return False

    def report(self) -> list[str]:
        return [f"{what} write failed {n} time(s), last: {err}" for what, (n, err) in self.failures.items()]

    def _write(self, tokens: list[int]) -> bool:
        if not self.best_effort("checkpoint", write_chunk, self.progress, self.start, tokens):
            return False
        self._row(self.start, self.start + len(tokens))
        self.start, self.buf = self.start + len(tokens), []
        self.due = self.w.spec.checkpoint_every
        return True

    def flush(self, all_tokens: list[int]) -> None:
        rest = all_tokens[self.start:]
        if rest:
            self._write(rest)
        self.snapshot(force=True)

    def finish(self, all_tokens: list[int]) -> None:
        """The timeline row of the tokens after the last chunk (they go to the output row, not to a chunk)."""
        self.timeline.truncate(len(all_tokens))  # a stop string may have ended the text inside the resumed tokens
        if len(all_tokens) > self.start:
            self._row(self.start, len(all_tokens))

    def _row(self, start: int, end: int) -> None:
        trim_heap()  # the heap's free pages back to the OS: every row reads the RSS of the memory in use
        now, counters = time.monotonic(), self.stats().snapshot()
        self.timeline.add(chunk_row(self.timeline.attempt, start, end, now - self.row_at, time.time(), self.row_stats,
                                    counters, socket.gethostname(), self.w.slot, rss_mb()))
        self.row_at, self.row_stats = now, counters
        self.best_effort("timeline", self.timeline.save)

    def snapshot(self, force: bool = False) -> None:
        """The recycling matrix, at most every spec.snapshot_seconds (not at every checkpoint: it can be MBs)."""
        if force or time.monotonic() - self.w.last_snapshot >= self.w.spec.snapshot_seconds:
            self.best_effort("recycling matrix", self.w.save_state)

    def _live(self, now: float, force: bool = False) -> None:
        if not force and now - self.last_live < LIVE_EVERY_S:
            return
        self.last_live = now
        new, elapsed = self.start + len(self.buf) - self.resumed, now - self.t0
        self.best_effort("live status", self.w.records.write_live, self.id, {
            "tokens": self.start + len(self.buf), "checkpointed": self.start, "max_tokens": self.max_tokens,
            "tokens_per_s": new / elapsed if elapsed > 0 else 0.0,
            "mean_accepted": new / self.steps if self.steps else 0.0,
            "pid": os.getpid(), "host": socket.gethostname(), "slot": self.w.slot, "updated_at": time.time(),
        })
