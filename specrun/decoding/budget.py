"""Adaptive trie size: verify the width w that maximises expected accepted tokens per second of decoding.

Measured online, no start-up calibration: each width's cost is the fastest of its recent whole steps (drafting included;
the minimum, because noise from other processes only ever adds time); trie nodes are kept in priority order, so one
step's accepted path tells what every smaller width accepts. A chain drafter's widths (sampled text) are judged against
the width in use instead, side by side: acceptance on the same steps, costs on neighbouring ones (chain_accepted,
chain_costs).
"""

from __future__ import annotations

import statistics
from collections import deque

EXPLORE_EVERY = 16  # every n-th step verifies the next wider width, so wider tries keep being measured
EXPLORE_EVERY_AR = 64  # while width 1 (plain AR) wins: the first gap to a wider step, doubled after each one that
EXPLORE_MAX_AR = 128  # ... loses, up to this (sampled text: drafts keep missing); width 1 this often while drafting wins
EXPLORE_MAX_SHADOWED = 1024  # the cap once shadow tries (shadow.py) measure the wider widths' acceptance (exploring then
# only re-times the wider widths' costs)
EMA = 0.1  # weight of a new acceptance observation once a width has 1/EMA of them (a running mean before that)
PAIR_HISTORY = 16  # a chain tuner pairs each step's cost with those of the widths stepped in this many steps before it
COST_WINDOW = 8  # a width's cost: the fastest of its last COST_WINDOW steps
PRIOR_ACCEPTED = 4.0  # optimistic start (min(w, 4) tokens) until a width's first observation replaces it: explore,
# then settle at once (weighed as an observation, it kept sampled text on missing drafts for ~25 steps)
WIDER_MARGIN = 0.03  # a wider width must beat the best narrower one by this much: noise alone never makes it slower
CHAIN_EMA = 0.03  # EMA of a chain drafter's acceptance: at 0.1 a few hard steps sent the tuner to plain AR for up to 64
# steps, or to widths that only the hard passage favoured
CHAIN_GAP_CAP = 0.3  # the most one chain observation after a gap weighs
CHAIN_STAY_MARGIN = 0.03  # a chain tuner's STAY_MARGIN: its estimates, side by side, do not wander as minima do, and
# 8% kept it at widths up to 8% slower than the best
STAY_MARGIN = 0.08  # a drafting width in use keeps its place unless another beats it by this much (never against plain
# AR, which a held width must still beat by WIDER_MARGIN: drafts that stop paying fall back as before). Costs are minima
# over windows of different ages, so while the host slows the width in use looks dearer than widths timed in a quieter
# spell (smollm2 sampled, 2,048 tokens: rates of widths 3-8 within ~10% of each other, and the tuner wandering among
# them ran 1.26 / 1.42 / 1.26x AR where a fixed width 6 ran 1.33 / 1.47 / 1.39x side by side)


def candidate_widths(max_budget: int, fine: bool = False) -> list[int]:
    """Powers of two up to max_budget (and it); fine: with 3 * 2^k between them (a chain drafter's widths, below)."""
    widths, w = [], 1
    while w < max_budget:
        widths.append(w)
        if fine and w >= 2 and w * 3 // 2 < max_budget:
            widths.append(w * 3 // 2)
        w *= 2
    return [*widths, max_budget]


class BudgetTuner:
    def __init__(self, max_budget: int, narrow_bounds: bool = True, chain: int = 0):
        """narrow_bounds: a narrower step's path bounds the wider widths' acceptance (below). Off for the 4-bit
        self-draft, whose narrow steps fill their width 95% of the time: every width-2 step then held width 4 at ~2
        tokens where it takes 3.7, and counting only the misses (a biased sample) held it at 2.6-2.8. Its widths are
        also the fine ones (6 between 4 and 8...): each of its nodes costs a forward, so a step's cost grows with its
        width where a tree's is flat up to ~16 rows (smollm2 sampled, 2,048 tokens: width 6 1.37-1.61x AR, 4 and 8
        1.41-1.47x and 1.18-1.52x, side by side)."""
        self.widths = candidate_widths(max_budget, fine=not narrow_bounds)
        self.narrow_bounds = narrow_bounds
        self._times = {w: deque(maxlen=COST_WINDOW) for w in self.widths}  # recent step seconds per width
        self.cost: dict[int, float] = {}  # seconds per step of w nodes, for the widths timed so far
        self.accepted = {w: min(float(w), PRIOR_ACCEPTED) for w in self.widths}
        self._acc_n = dict.fromkeys(self.widths, 0)  # observations so far (the prior is none)
        self.step = 0
        self._ar_gap = EXPLORE_EVERY_AR  # steps from one wider step to the next while width 1 wins
        self._ar_next = EXPLORE_EVERY_AR  # the step of the next one
        self._shadowed = False  # acceptance also comes from shadow tries, so wider steps need not explore for it
        self._held: int | None = None  # index of the width in use (the last choice that was not exploring)
        self.chain = chain  # widths from 2 up to this: a chain drafter's, judged against the width in use (below)
        self._ema = CHAIN_EMA if chain else EMA
        self._pair = {w: [0.0, 0.0] for w in self.widths}  # a chain width's acceptance and the width below's, same steps
        self._recent: deque[tuple[int, float]] = deque(maxlen=PAIR_HISTORY)  # a chain tuner's last steps: (width, s)
        self._cost_pair: dict[tuple[int, int], list[float]] = {}  # (lo, hi): [observations, hi's cost over lo's]
        self._seen_at: dict[int, int] = {}  # a chain width's step of its last acceptance observation
        self._stay = CHAIN_STAY_MARGIN if chain else STAY_MARGIN

    def estimated_cost(self, w: int) -> float | None:
        """w's measured cost, never below plain AR's (costs are minima over windows of different ages: a rarely verified
        width keeps a fast one from a quiet spell while plain AR's is fresh, which made missing drafts look cheaper than
        AR). Unmeasured: the widest measured width's below it (optimistic: explore the next width up), doubled for each
        width skipped past that one (a 64-node step is no 2-node step). None if nothing is known."""
        measured = [v for v in self.widths if v <= w and v in self.cost]
        if not measured:
            return None
        cost = self.cost[measured[-1]] * 2 ** max(0, self.widths.index(w) - self.widths.index(measured[-1]) - 1)
        return max(cost, self.cost.get(self.widths[0], 0.0))

    def choose(self) -> int:
        self.step += 1
        rates, accepted = [], self.chain_accepted() if self.chain else self.accepted
        held_w = self.widths[self._held or 0]
        paired = self.chain_costs(held_w) if self.chain else {}
        scale = paired[held_w] / self.cost[held_w] if paired and held_w in self.cost else 1.0  # median over minimum
        for i, w in enumerate(self.widths):
            c = paired.get(w) or (None if (e := self.estimated_cost(w)) is None else e * scale)
            if c is None:  # nothing measured yet: time the narrowest width first
                return w
            if len(self._times[w]) == 1:  # timed once: that first step paid one-off set-up (new shapes), time it again
                return w
            rates.append((accepted[w] / c, i))
        best_rate, best = rates[0]
        for rate, i in rates[1:]:
            if rate > best_rate * (1 + WIDER_MARGIN):
                best_rate, best = rate, i
        held = self._held  # held between drafting widths only: plain AR is left and taken back as before (WIDER_MARGIN)
        if held and best and rates[held][0] > rates[0][0] * (1 + WIDER_MARGIN) \
                and rates[held][0] * (1 + self._stay) >= best_rate:
            best = held
        self._held = best
        if best == 0:  # plain AR wins: one wider step now and then, less often each time (it costs more than it finds)
            if self.step < self._ar_next:
                return self.widths[0]
            self._ar_next = self.step + self._ar_gap
            self._ar_gap = min(2 * self._ar_gap, EXPLORE_MAX_SHADOWED if self._shadowed else EXPLORE_MAX_AR)
            return self.widths[min(1, len(self.widths) - 1)]
        self._ar_gap, self._ar_next = EXPLORE_EVERY_AR, self.step + EXPLORE_EVERY_AR
        if self.step % EXPLORE_EVERY_AR == 0:  # re-time plain AR, whose cost a slow spell may have left too high
            return self.widths[0]  # (costs are minima): drafting must never lose to it unnoticed
        if self.step % EXPLORE_EVERY == 0:  # one wider: measures the next width up
            best = min(best + 1, len(self.widths) - 1)
        return self.widths[best]

    def observe(self, used: int, path_nodes: list[int], seconds: float, nodes: float | None = None) -> None:
        """path_nodes: trie indices of the accepted path beyond the root (ascending); seconds: the whole step; nodes:
        how many the trie held (default `used`)."""
        self.observe_batch(used, [path_nodes], seconds, nodes)

    def observe_batch(self, used: int, paths: list[list[int]], seconds: float, nodes: float | None = None) -> None:
        """One step of several sequences (each its own trie of width `used`): their mean acceptance is one
        observation, so a batch moves the estimate as much as one sequence's step does. nodes: the tries' mean size.

        The time is a cost of the narrowest width that holds the nodes verified: a drafter with nothing to propose
        leaves a width-4 step at one node, as cheap as plain AR, and the minimum of such steps made width 4 look free
        (n-gram drafts on sampled text, temperature 0.6: 3.4 nodes a step for 1.07 tokens, 0.81x AR)."""
        # nodes are in priority order, so the step tells exactly what every width up to `used` accepts; of wider
        # widths only a lower bound, which wears their estimates down to this width's: taken while nothing better is
        # known (it brings plain AR back fast where drafts miss), not once shadow tries measure the wider widths
        # exactly (else a drafter whose deeper nodes pay would never be tried wider). A plain AR step drafted nothing:
        # it says nothing of wider widths (its bound of 1 token would wear them all down to plain AR).
        bounds = self.narrow_bounds and used > 1 and not self._shadowed
        wider = self.widths if bounds else [w for w in self.widths if w <= used]
        self._observe_accepted(used, paths, wider)
        size = used if nodes is None else nodes
        timed = next(w for w in self.widths if w >= size)
        times = self._times[timed]
        times.append(seconds)
        self.cost[timed] = min(times)
        if self.chain and used <= self.chain and len(times) > 1:  # not a width's first step (its set-up)
            self._pair_cost(used, seconds)

    def _pair_cost(self, w: int, seconds: float) -> None:
        """A chain width's step against each width stepped in the last PAIR_HISTORY steps: its cost over their median,
        one observation of the pair's ratio. Taken side by side, a ratio holds through a slow spell where minima per
        width do not (one timed in a quieter spell looked cheaper than the width in use: the tuner wandered among widths
        3-8), and where a linear model of chain steps did not (its minima of the rest of a step came from the steps that
        accepted least: width 12 ran at 73 ms a step against 64 modelled, 1.31x AR where width 6 ran 1.57x)."""
        by_width: dict[int, list[float]] = {}
        for v, s in self._recent:
            by_width.setdefault(v, []).append(s)
        for v, times in by_width.items():
            if v != w and len(times) >= 2:
                ratio = seconds / statistics.median(times)
                lo, hi, r = (v, w, ratio) if v < w else (w, v, 1.0 / ratio)
                pair = self._cost_pair.setdefault((lo, hi), [0, 1.0])
                pair[0] += 1
                pair[1] += max(EMA, 1.0 / pair[0]) * (r - pair[1])
        self._recent.append((w, seconds))

    def chain_costs(self, held: int) -> dict[int, float]:
        """Each chain width's cost (and plain AR's): the width in use's median of its recent steps times the pair's ratio
        (_pair_cost); the widths without one are left out (the caller falls back on estimated_cost)."""
        times = [s for v, s in self._recent if v == held]
        if len(times) < 2:
            return {}
        now = statistics.median(times)
        costs = {held: now}
        for (lo, hi), (_, ratio) in self._cost_pair.items():
            if lo == held:
                costs[hi] = now * ratio
            elif hi == held:
                costs[lo] = now / ratio
        return costs

    def observe_shadow(self, paths: list[list[int]]) -> None:
        """Accepted paths of full-width tries that narrower steps verified only in part (shadow.py), one observation: exact
        acceptance for every wider width, at no cost to time."""
        if not self._shadowed:  # what wider widths held so far were lower bounds (narrower steps): start from exact data
            for w in self.widths[1:]:
                self._acc_n[w] = 0
        self._observe_accepted(self.widths[-1], paths, self.widths[1:])
        self._shadowed = True

    def _observe_accepted(self, used: int, paths: list[list[int]], widths: list[int]) -> None:
        below = 1.0  # the acceptance of the width before w (a chain tuner's widths come as a prefix: 1, 2, 3, 4, 6...)
        for w in widths:
            acc = 1 + sum(sum(1 for i in path if i < min(w, used)) for path in paths) / len(paths)
            self._acc_n[w] += 1
            rate = max(self._ema, 1.0 / self._acc_n[w])
            if self.chain:  # a width observed after a gap (exploring) stands for the steps since: else a ratio pulled
                # to ~1 by a hard passage took ~500 steps to recover, and the tuner stayed narrow
                rate = max(rate, min(CHAIN_GAP_CAP, self._ema * (self.step - self._seen_at.get(w, self.step))))
                self._seen_at[w] = self.step
            self.accepted[w] += rate * (acc - self.accepted[w])
            if self.chain and w > 1:  # w and the width below it on the same steps (chain_accepted)
                pair = self._pair[w]
                pair[0] += rate * (acc - pair[0])
                pair[1] += rate * (below - pair[1])
            below = acc

    def chain_accepted(self) -> dict[int, float]:
        """A chain's widths' acceptance: each one's own recent mean up to the width in use (every step observes them),
        above it the width below's times the ratio of the two on the steps that verified both. Their own means come from
        the few wider steps (exploring), on older text than the width in use's: a hard passage then made the next wider
        width look better than the one in use (smollm2 sampled: width 8 for 30% of the steps, ~1.5% slower than 6)."""
        held = self.widths[self._held or 0]
        acc = {}
        for i, w in enumerate(self.widths):
            pair = self._pair[w]
            above = w > held and w <= self.chain and pair[1] > 0
            acc[w] = acc[self.widths[i - 1]] * pair[0] / pair[1] if above else self.accepted[w]
        return acc
