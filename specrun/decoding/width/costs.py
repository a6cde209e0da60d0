"""What a step of each width costs, measured online: the fastest of its recent whole steps (noise from other processes
only ever adds time), and for a chain drafter the ratio of two widths' costs taken side by side on neighbouring steps.
"""

from __future__ import annotations

import statistics
from collections import deque

COST_WINDOW = 8  # a width's cost: the fastest of its last COST_WINDOW steps
PAIR_HISTORY = 16  # a step's cost is paired with those of the widths stepped in this many steps before it
RATIO_EMA = 0.1  # weight of a new ratio observation once a pair has 1/RATIO_EMA of them (a running mean before)


class StepCosts:
    """Seconds a step of each width, as the minimum of its last COST_WINDOW steps."""

    def __init__(self, widths: list[int]):
        self.widths = widths
        self._times = {w: deque(maxlen=COST_WINDOW) for w in widths}  # recent step seconds per width
        self.cost: dict[int, float] = {}  # seconds per step of w nodes, for the widths timed so far

    def timed(self, w: int) -> int:
        """How many of w's recent steps were timed (a width timed once paid one-off set-up: time it again)."""
        return len(self._times[w])

    def observe(self, nodes: float, seconds: float) -> int:
        """A step that verified `nodes` nodes: a cost of the narrowest width holding them (a drafter with nothing to
        propose leaves a wide step as cheap as plain AR, which is not what a full step of that width costs). -> how
        many steps that width's window now holds."""
        timed = next(w for w in self.widths if w >= nodes)
        times = self._times[timed]
        times.append(seconds)
        self.cost[timed] = min(times)
        return len(times)

    def estimated(self, w: int) -> float | None:
        """w's measured cost, never below plain AR's (a rarely verified width keeps a minimum from a quiet spell while
        plain AR's is fresh). Unmeasured: the widest measured width's below it, doubled for each width skipped past
        that one (optimistic: the next width up gets explored). None if nothing is known."""
        measured = [v for v in self.widths if v <= w and v in self.cost]
        if not measured:
            return None
        cost = self.cost[measured[-1]] * 2 ** max(0, self.widths.index(w) - self.widths.index(measured[-1]) - 1)
        return max(cost, self.cost.get(self.widths[0], 0.0))


class PairedCosts:
    """A chain drafter's widths' costs relative to each other: each step's seconds over the median of each width stepped
    shortly before it, one observation of that pair's ratio. A ratio taken side by side holds through a slow spell,
    where minima per width (StepCosts) timed in different spells do not."""

    def __init__(self):
        self._recent: deque[tuple[int, float]] = deque(maxlen=PAIR_HISTORY)  # the last steps: (width, seconds)
        self._ratio: dict[tuple[int, int], list[float]] = {}  # (lo, hi): [observations, hi's cost over lo's]

    def observe(self, w: int, seconds: float) -> None:
        by_width: dict[int, list[float]] = {}
        for v, s in self._recent:
            by_width.setdefault(v, []).append(s)
        for v, times in by_width.items():
            if v != w and len(times) >= 2:
                ratio = seconds / statistics.median(times)
                lo, hi, r = (v, w, ratio) if v < w else (w, v, 1.0 / ratio)
                pair = self._ratio.setdefault((lo, hi), [0, 1.0])
                pair[0] += 1
                pair[1] += max(RATIO_EMA, 1.0 / pair[0]) * (r - pair[1])
        self._recent.append((w, seconds))

    def costs(self, held: int) -> dict[int, float]:
        """Each paired width's cost (plain AR's included): the held width's median of its recent steps times the pair's
        ratio; widths without a ratio to it are left out (the caller falls back on StepCosts.estimated)."""
        times = [s for v, s in self._recent if v == held]
        if len(times) < 2:
            return {}
        now = statistics.median(times)
        costs = {held: now}
        for (lo, hi), (_, ratio) in self._ratio.items():
            if lo == held:
                costs[hi] = now * ratio
            elif hi == held:
                costs[lo] = now / ratio
        return costs
