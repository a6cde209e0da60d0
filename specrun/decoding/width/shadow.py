"""Counterfactual acceptance of wider tries: every so often a step narrower than the full width drafts a full-width
trie, verifies only its first nodes, and keeps the whole trie to walk later.

Position-keyed sampling accepts a node iff its token is the one AR emits at its position (docs/design.md section 3),
so walking the trie over the tokens AR then emits gives exactly the path its verify would have accepted, with no
forward paid.
"""

from __future__ import annotations

import torch

from specrun.decoding.drafters.protocol import DRAFTS_BY_FORWARD
from specrun.decoding.verify.trie import Trie, walk

SHADOW_EVERY = 16  # steps between shadow tries of one sequence (a full n-gram + recycling draft: ~0.4 ms)
# after a shadow that accepted SHADOW_SOON_PATH drafted tokens or more, the next comes SHADOW_SOON steps later: where wide
# tries pay (a repeating passage) the tuner learns it 4x sooner; where drafts miss (sampled text) shadows cost as before
SHADOW_SOON = 4
SHADOW_SOON_PATH = 2


def shadowable(drafters: tuple[str, ...]) -> bool:
    """Shadows need drafts that cost no forward of the model: not for heads or the 4-bit self-draft."""
    return bool(drafters) and not any(n in DRAFTS_BY_FORWARD for n in drafters)


class Shadow:
    """One sequence's shadow trie in flight: take() at a narrow step, resolve() as its tokens come in."""

    def __init__(self):
        self.trie: Trie | None = None
        self.start = 0  # index in the output of the token AR emits at the trie's root
        self.wait = 0  # steps until the next shadow may be taken

    def due(self) -> bool:
        """Counts a step narrower than the full width; True when a shadow trie should be drafted at this one."""
        if self.trie is not None:
            return False
        self.wait -= 1
        return self.wait < 0

    def take(self, trie: Trie, n_out: int) -> None:
        """trie: drafted at the step whose root emits out[n_out] (n_out = tokens generated before that step)."""
        self.trie, self.start = trie, n_out

    def resolve(self, out: list[int]) -> list[int] | None:
        """The trie's accepted path (node indices beyond the root) once AR has emitted every token it decides on."""
        trie = self.trie
        if trie is None:
            return None
        depth = int(trie.depths.max())
        if len(out) < self.start + depth:
            return None
        # a node at depth d is followed by AR's token at output index start + d (no node needs the one after the deepest)
        known = torch.tensor(out[self.start : self.start + depth + 1], dtype=torch.long)
        choice = torch.full((depth + 1,), -1, dtype=torch.long)
        choice[: known.numel()] = known
        self.trie = None
        path = walk(trie, choice.to(trie.depths.device)[trie.depths]).tolist()[1:]
        # the wait runs from here: due() counts no step while a trie is in flight
        self.wait = (SHADOW_SOON if len(path) >= SHADOW_SOON_PATH else SHADOW_EVERY) - 1
        return path
