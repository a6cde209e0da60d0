"""The per-sequence parts of a decoding step: a sequence and its tuner made, propose (drafters asked in drafting
order, merged in priority order, a shadow's full-width draft where one is due) and accept (choose, walk, stop rules,
commit, advance, update drafters, record).

The engine (engine.py) owns the rest: admission, the width, the verify forward and the KV layout (anything with
commit(path)).
"""

from __future__ import annotations

import torch

from specrun.decoding.drafters.protocol import MERGE_PRIORITY, NOISE_COUPLED, Drafter, Verified
from specrun.decoding.drafters.quant_draft import MAX_CHAIN
from specrun.decoding.stats import GenStats
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import Draft, DraftContext, Trie, build_trie, merge_drafts, record_sampled, walk
from specrun.decoding.width.shadow import Shadow
from specrun.decoding.width.tuner import WidthTuner


def new_sequence(lm, prompt_ids: list[int], params: SamplingParams, resumed: list[int], vocab_size: int,
                 spare: int) -> Sequence:
    """A sequence of lm's (its EOS ids, tokenizer, context and device) with room for `spare` rows of a verify."""
    return Sequence(prompt_ids, params, resumed, vocab_size=vocab_size, eos_ids=lm.eos_ids, tokenizer=lm.tokenizer,
                    max_context=lm.max_context, spare=spare, device=lm.device)


def width_tuner(max_width: int, quant: bool, greedy: bool = False) -> WidthTuner:
    """The width tuner of an engine; quant: the 4-bit self-draft runs, whose chain leads every trie at a forward a
    token (sampled, it always drafts: the chain tuner; greedy, the n-gram copy drafts where it can)."""
    return WidthTuner(max_width, narrow_bounds=not quant, chain=MAX_CHAIN + 1 if quant and not greedy else 0)


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


def draft(drafting: Drafting, drafters: list[Drafter], st: Sequence, budget: int, full: int, shadow: Shadow | None,
          device) -> list[Draft]:
    """This step's drafts for a trie of `budget` nodes (none at width 1: it verifies the root alone). Where a shadow is
    due at a narrower step they fill a full-width trie, which the shadow keeps; the verified trie is its first nodes."""
    shadowing = shadow is not None and budget < full and shadow.due()
    if budget <= 1 and not shadowing:
        return []
    drafts = drafting.propose(drafters, st.draft_context(full if shadowing else budget, bool(drafting.coupled)))
    if shadowing:
        shadow.take(build_trie(st.root, drafts, full, device), len(st.out))
    return drafts


def accept(st: Sequence, trie: Trie, logits: torch.Tensor, hidden: torch.Tensor, kv, drafters: list[Drafter],
           stats: GenStats, coupled: list[int], width: int, learns_elsewhere: tuple[str, ...] = (),
           chosen: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[list[int], list[int]]:
    """Walk the verified trie, apply the stop rules, commit the accepted nodes' K/V (kv.commit) and tokens, let the
    drafters learn (but those named in learns_elsewhere: the batch teaches its shared matrix once), record the step.
    chosen: st.choose's result where the batch took it already (choose_together).

    # logits: [T, V], hidden: [T, H] (the trie's rows) -> (accepted path nodes beyond the root, emitted tokens)
    """
    with stats.time("walk"):
        choice, processed = chosen if chosen is not None else st.choose(trie, logits)
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
