"""Expected accepted tokens a step, per width: trie nodes are kept in priority order, so one step's accepted path tells
what every width up to the one verified would have kept; each width's estimate is a running mean, then an EMA of that.
A chain drafter's widths above the one in use are estimated by their ratio to the width below on the steps that
verified both (their own means come from the few wider steps, on older text).
"""

from __future__ import annotations

EMA = 0.1  # weight of a new observation once a width has 1/EMA of them (a running mean before that)
PRIOR_ACCEPTED = 4.0  # the estimate of a width never observed: min(w, 4) tokens, optimistic, so it gets explored; the
# first observation replaces it outright
CHAIN_EMA = 0.03  # a chain drafter's EMA: slower, so a few hard steps do not send the tuner to plain AR
CHAIN_GAP_CAP = 0.3  # a chain width observed after a gap stands for the steps since, weighing at most this much


class Acceptance:
    def __init__(self, widths: list[int], chain: int = 0):
        """chain: widths up to this are a chain drafter's (one forward a drafted token), estimated by ratios above the
        width in use; 0: none."""
        self.widths, self.chain = widths, chain
        self.mean = {w: min(float(w), PRIOR_ACCEPTED) for w in widths}  # each width's own estimate
        self._n = dict.fromkeys(widths, 0)  # observations so far (the prior is none)
        self._ema = CHAIN_EMA if chain else EMA
        self.pair = {w: [0.0, 0.0] for w in widths}  # chain: w's acceptance and the width below's, on the same steps
        self._seen_at: dict[int, int] = {}  # chain: the step of w's last observation

    def forget(self, widths: list[int]) -> None:
        """Restart these widths' means from their next observation (what they held were lower bounds)."""
        for w in widths:
            self._n[w] = 0

    def observe(self, used: int, paths: list[list[int]], widths: list[int], step: int) -> None:
        """One observation for each of `widths` (ascending): the mean over paths of 1 + the accepted nodes (trie indices
        beyond the root) that width w of a step verifying `used` nodes would have held."""
        below = 1.0  # the width before w's acceptance (a chain's widths come as a prefix: 1, 2, 3, 4, 6...)
        for w in widths:
            acc = 1 + sum(sum(1 for i in path if i < min(w, used)) for path in paths) / len(paths)
            self._n[w] += 1
            rate = max(self._ema, 1.0 / self._n[w])
            if self.chain:  # observed after a gap (exploring): it stands for the steps since, else a hard passage's
                # low value would take hundreds of steps to wear off
                rate = max(rate, min(CHAIN_GAP_CAP, self._ema * (step - self._seen_at.get(w, step))))
                self._seen_at[w] = step
            self.mean[w] += rate * (acc - self.mean[w])
            if self.chain and w > 1:
                pair = self.pair[w]
                pair[0] += rate * (acc - pair[0])
                pair[1] += rate * (below - pair[1])
            below = acc

    def chained(self, held: int) -> dict[int, float]:
        """A chain's estimates: each width's own mean up to the held width (every step observes those), above it the
        width below's estimate times the ratio of the two on the steps that verified both."""
        acc = {}
        for i, w in enumerate(self.widths):
            pair = self.pair[w]
            above = w > held and w <= self.chain and pair[1] > 0
            acc[w] = acc[self.widths[i - 1]] * pair[0] / pair[1] if above else self.mean[w]
        return acc
