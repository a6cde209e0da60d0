"""Per-generation statistics: steps, accepted tokens per step, tokens per drafter, seconds per phase.

Cheap to update every step (counters only); `as_dict` is what results and job outputs carry.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager

PHASES = ("prefill", "draft", "trie", "forward", "walk", "commit", "update")


class GenStats:
    def __init__(self, drafter_names: tuple[str, ...]):
        self.drafter_names = drafter_names
        self.steps = 0
        self.new_tokens = 0
        self.accepted_hist: Counter[int] = Counter()
        self.by_drafter: Counter[str] = Counter()
        self.nodes = 0
        self.phase = dict.fromkeys(PHASES, 0.0)
        self.t0 = time.perf_counter()

    @contextmanager
    def time(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phase[phase] += time.perf_counter() - t

    def record_step(self, emitted: int, trie_nodes: int, accepted_sources: list[int]) -> None:
        self.steps += 1
        self.new_tokens += emitted
        self.nodes += trie_nodes
        self.accepted_hist[emitted] += 1
        for s in accepted_sources:
            self.by_drafter[self.drafter_names[s]] += 1

    def as_dict(self) -> dict:
        seconds = time.perf_counter() - self.t0
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "mean_accepted": self.new_tokens / self.steps if self.steps else 0.0,
            "accepted_hist": {str(k): v for k, v in sorted(self.accepted_hist.items())},
            "tokens_by_drafter": {n: self.by_drafter.get(n, 0) for n in self.drafter_names},
            "mean_trie_nodes": self.nodes / self.steps if self.steps else 0.0,
            "phase_seconds": {k: round(v, 6) for k, v in self.phase.items()},
            "seconds": seconds,
            "tokens_per_s": self.new_tokens / seconds if seconds > 0 else 0.0,
        }
