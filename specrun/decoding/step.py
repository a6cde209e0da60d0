"""The per-sequence parts of a decoding step, one copy for every engine: propose (drafters asked in drafting order,
merged in priority order) and accept (choose, walk, stop rules, commit, advance, update drafters, record).

The engines own the rest: admission, the width, the verify forward and their KV layout (anything with commit(path)).
"""

from __future__ import annotations

import torch

from specrun.decoding.drafters.protocol import MERGE_PRIORITY, NOISE_COUPLED, Drafter, Verified
from specrun.decoding.stats import GenStats
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import Draft, DraftContext, Trie, merge_drafts, record_sampled, walk


class Drafting:
    """How the drafters named (in drafting order) are merged: their priority order, and who draws AR's own noise."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names
        self.order = sorted(range(len(names)), key=lambda i: MERGE_PRIORITY.index(names[i]))
        self._ahead = [self.order[: self.order.index(i)] for i in range(len(names))]  # merged before drafter i
        self.coupled = [i for i, n in enumerate(names) if n in NOISE_COUPLED]  # draft with AR's own noise

    def propose(self, drafters: list[Drafter], ctx: DraftContext) -> list[Draft]:
        """Every drafter's proposals in merge order; a drafter is not asked once those merged before it hold the
        budget (the 4-bit self-draft's chain fills a width-4 trie: n-gram and recycling drafts would be dropped)."""
        proposals: list[list[Draft] | None] = [None] * len(drafters)
        for i, drafter in enumerate(drafters):  # drafting order: a head's guess keys the n-grams after it
            ahead = [d for j in self._ahead[i] if proposals[j] is not None for d in proposals[j]]
            # merged nodes are at most 1 + the drafted tokens: only a budget that many tokens could fill is merged
            full = all(proposals[j] is not None for j in self._ahead[i]) \
                and sum(len(d.tokens) - 1 for d in ahead) >= ctx.budget - 1 \
                and len(merge_drafts(ctx.root, ahead, ctx.budget)[0]) >= ctx.budget
            proposals[i] = [] if full else drafter.propose(ctx, i)
        return [d for i in self.order for d in proposals[i]]


def accept(st: Sequence, trie: Trie, logits: torch.Tensor, hidden: torch.Tensor, kv, drafters: list[Drafter],
           stats: GenStats, coupled: list[int], width: int, learns_elsewhere: tuple[str, ...] = ()
           ) -> tuple[list[int], list[int]]:
    """Walk the verified trie, apply the stop rules, commit the accepted nodes' K/V (kv.commit) and tokens, let the
    drafters learn (but those named in learns_elsewhere: the batch teaches its shared matrix once), record the step.

    # logits: [T, V], hidden: [T, H] (the trie's rows) -> (accepted path nodes beyond the root, emitted tokens)
    """
    with stats.time("walk"):
        choice, processed = st.choose(trie, logits)
        path = walk(trie, choice)
        emitted = st.stop_rules(choice[path].tolist())
        if not st.params.greedy:  # drafted mass vs what happened, and the likeliest-chain oracle
            record_sampled(stats, trie, processed, choice, path, len(emitted), coupled)
        nodes = path.tolist()
    with stats.time("commit"):
        kv.commit(path[: len(emitted)])  # K/V of root..(k-1)th accepted node
        st.advance(emitted)
    with stats.time("update"):
        verified = Verified(trie.tokens, logits, hidden, nodes[len(emitted) - 1])
        for d in drafters:
            if d.name not in learns_elsewhere:
                d.observe(verified)
            d.commit(emitted)
    stats.record_step(len(emitted), trie.size, trie.path_tokens.shape[1], trie.sources[path[1 : len(emitted)]].tolist(),
                      len(st.out) - len(emitted), width=width)
    return nodes[1:], emitted
