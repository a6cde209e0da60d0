"""The trie width of each step: the one with the best expected accepted tokens per second of decoding.

choose() = the best of (acceptance.py's estimate / costs.py's cost) over the candidate widths, held with hysteresis,
left only to explore (explore.py). Measured online from whole steps (drafting included), no start-up calibration.
"""

from __future__ import annotations

from specrun.decoding.width.acceptance import Acceptance
from specrun.decoding.width.costs import PairedCosts, StepCosts
from specrun.decoding.width.explore import Exploration

WIDER_MARGIN = 0.03  # a wider width must beat the best narrower one by this much: noise alone never makes it slower
STAY_MARGIN = 0.08  # a drafting width in use keeps its place unless another beats it by this much
CHAIN_STAY_MARGIN = 0.03  # STAY_MARGIN of a chain tuner, whose estimates, taken side by side, wander less


def candidate_widths(max_width: int, fine: bool = False) -> list[int]:
    """Powers of two up to max_width (and it); fine: with 3 * 2^k between them (a chain drafter's widths)."""
    widths, w = [], 1
    while w < max_width:
        widths.append(w)
        if fine and w >= 2 and w * 3 // 2 < max_width:
            widths.append(w * 3 // 2)
        w *= 2
    return [*widths, max_width]


class WidthTuner:
    def __init__(self, max_width: int, narrow_bounds: bool = True, chain: int = 0):
        """narrow_bounds: a narrower step's path bounds the wider widths' acceptance from below (off for a chain
        drafter, whose narrow steps fill their width: the bound would hold it narrow). chain: widths from 2 up to this
        are a chain drafter's (each node a forward, so cost grows with width): fine widths, and costs and acceptance
        judged against the width in use, side by side (PairedCosts, Acceptance.chained)."""
        self.widths = candidate_widths(max_width, fine=not narrow_bounds)
        self.narrow_bounds, self.chain = narrow_bounds, chain
        self.costs = StepCosts(self.widths)
        self.paired = PairedCosts()
        self.acceptance = Acceptance(self.widths, chain)
        self.exploration = Exploration()
        self.step = 0
        self.shadowed = False  # acceptance also comes from shadow tries (shadow.py): exact for the wider widths
        self._held: int | None = None  # index of the width in use (the last choice that was not exploring)
        self._stay = CHAIN_STAY_MARGIN if chain else STAY_MARGIN

    @property
    def accepted(self) -> dict[int, float]:
        return self.acceptance.mean

    @property
    def cost(self) -> dict[int, float]:
        return self.costs.cost

    def estimated_cost(self, w: int) -> float | None:
        return self.costs.estimated(w)

    def chain_costs(self, held: int) -> dict[int, float]:
        return self.paired.costs(held)

    def chain_accepted(self) -> dict[int, float]:
        return self.acceptance.chained(self.widths[self._held or 0])

    def choose(self) -> int:
        """The width of the next step. A width never timed, or timed once (its first step paid one-off set-up), is
        timed first, narrowest first. Else the best rate wins, a wider width only by WIDER_MARGIN; the drafting width in
        use stays while within its stay margin of the best and ahead of plain AR by WIDER_MARGIN."""
        self.step += 1
        held_w = self.widths[self._held or 0]
        accepted = self.chain_accepted() if self.chain else self.accepted
        paired = self.chain_costs(held_w) if self.chain else {}
        scale = paired[held_w] / self.cost[held_w] if paired and held_w in self.cost else 1.0  # median over minimum
        rates = []
        for w in self.widths:
            c = paired.get(w) or (None if (e := self.estimated_cost(w)) is None else e * scale)
            if c is None or self.costs.timed(w) == 1:
                return w
            rates.append(accepted[w] / c)
        best = 0
        for i in range(1, len(rates)):
            if rates[i] > rates[best] * (1 + WIDER_MARGIN):
                best = i
        held = self._held
        if held and best and rates[held] > rates[0] * (1 + WIDER_MARGIN) and rates[held] * (1 + self._stay) >= rates[best]:
            best = held
        self._held = best
        return self.widths[self.exploration.width(self.step, best, len(self.widths), self.shadowed)]

    def observe(self, used: int, path_nodes: list[int], seconds: float, nodes: float | None = None) -> None:
        """path_nodes: trie indices of the accepted path beyond the root (ascending); seconds: the whole step; nodes:
        how many the trie held (default `used`)."""
        self.observe_batch(used, [path_nodes], seconds, nodes)

    def observe_batch(self, used: int, paths: list[list[int]], seconds: float, nodes: float | None = None) -> None:
        """One step of several sequences (each its own trie of width `used`): their mean acceptance is one
        observation. nodes: the tries' mean size. A step of width > 1 bounds the wider widths' acceptance from below
        (narrow_bounds), until shadow tries measure them exactly; a plain AR step says nothing of them."""
        bounds = self.narrow_bounds and used > 1 and not self.shadowed
        self.acceptance.observe(used, paths, self.widths if bounds else [w for w in self.widths if w <= used],
                                self.step)
        timed = self.costs.observe(used if nodes is None else nodes, seconds)
        if self.chain and used <= self.chain and timed > 1:  # not a width's first step (its set-up)
            self.paired.observe(used, seconds)

    def observe_shadow(self, paths: list[list[int]]) -> None:
        """Accepted paths of full-width tries that narrower steps verified only in part (shadow.py), one observation:
        exact acceptance for every wider width, at no cost to time."""
        if not self.shadowed:  # what the wider widths held were lower bounds: start from exact data
            self.acceptance.forget(self.widths[1:])
        self.acceptance.observe(self.widths[-1], paths, self.widths[1:], self.step)
        self.shadowed = True
