"""Adaptive trie size: verify the width w that maximises expected accepted tokens per second of decoding.

Cost per width starts from a calibrated forward and is refined online with whole steps (drafting included); since trie
nodes are kept in priority order, one step's accepted path tells exactly how many tokens every smaller width accepts.
"""

from __future__ import annotations

import time
from typing import Callable

EXPLORE_EVERY = 16  # every n-th step verifies the next wider width, so wider tries keep being measured
EMA = 0.1


def candidate_widths(max_budget: int) -> list[int]:
    widths, w = [], 1
    while w < max_budget:
        widths.append(w)
        w *= 2
    return [*widths, max_budget]


class BudgetTuner:
    def __init__(self, max_budget: int, forward_cost: Callable[[int], float]):
        self.widths = candidate_widths(max_budget)
        self.cost = {w: forward_cost(w) for w in self.widths}  # seconds per step of w nodes (forward-only at first)
        self.accepted = {w: float(min(w, 4)) for w in self.widths}  # optimistic start: explore before settling
        self.step = 0

    def choose(self) -> int:
        self.step += 1
        best = max(range(len(self.widths)), key=lambda i: self.accepted[self.widths[i]] / self.cost[self.widths[i]])
        if self.step % EXPLORE_EVERY == 0:  # one step wider: cheap to try, and it measures the next width up
            best = min(best + 1, len(self.widths) - 1)
        return self.widths[best]

    def observe(self, used: int, path_nodes: list[int], seconds: float) -> None:
        """path_nodes: trie indices of the accepted path beyond the root (ascending)."""
        for w in self.widths:
            if w > used:
                break
            acc = 1 + sum(1 for i in path_nodes if i < w)
            self.accepted[w] += EMA * (acc - self.accepted[w])
        if used in self.cost:
            self.cost[used] += EMA * (seconds - self.cost[used])


def calibrate(run_forward: Callable[[int], None], repeats: int = 3) -> Callable[[int], float]:
    """-> cost(w): the best of `repeats` timed run_forward(w) calls, after one warm-up call."""

    def cost(w: int) -> float:
        run_forward(w)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            run_forward(w)
            best = min(best, time.perf_counter() - t)
        return best

    return cost
