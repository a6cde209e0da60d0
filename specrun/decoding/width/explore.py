"""When a step leaves the best width to measure another one: costs and acceptance are only known where steps go.

While a drafting width wins: every EXPLORE_EVERY-th step verifies the next wider width, every EXPLORE_EVERY_AR-th plain
AR (so drafting never loses to it unnoticed). While plain AR wins: one step of the next width after a gap that doubles
each time, up to EXPLORE_MAX_AR, or EXPLORE_MAX_SHADOWED once shadow tries measure the wider widths' acceptance.
"""

from __future__ import annotations

EXPLORE_EVERY = 16
EXPLORE_EVERY_AR = 64
EXPLORE_MAX_AR = 128
EXPLORE_MAX_SHADOWED = 1024


class Exploration:
    def __init__(self):
        self._ar_gap = EXPLORE_EVERY_AR  # steps from one wider step to the next while plain AR wins
        self._ar_next = EXPLORE_EVERY_AR  # the step of the next one

    def width(self, step: int, best: int, n_widths: int, shadowed: bool) -> int:
        """The index of the width step `step` verifies, given the best width's index (0: plain AR)."""
        if best == 0:
            if step < self._ar_next:
                return 0
            self._ar_next = step + self._ar_gap
            self._ar_gap = min(2 * self._ar_gap, EXPLORE_MAX_SHADOWED if shadowed else EXPLORE_MAX_AR)
            return min(1, n_widths - 1)
        self._ar_gap, self._ar_next = EXPLORE_EVERY_AR, step + EXPLORE_EVERY_AR
        if step % EXPLORE_EVERY_AR == 0:
            return 0
        if step % EXPLORE_EVERY == 0:
            return min(best + 1, n_widths - 1)
        return best
