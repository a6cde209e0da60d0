"""The per-sequence parts of a step every engine shares (decoding/step.py), alone: who is asked to draft, in what order
drafts merge, and what accepting a verified trie commits, emits, teaches and records."""

from __future__ import annotations

import torch

from specrun.decoding.stats import GenStats
from specrun.decoding.step import Drafting, accept
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import Draft, DraftContext, build_trie

V = 16


class Chain:
    """A drafter proposing one fixed chain under the root; records what it was asked and taught."""

    def __init__(self, name: str, tokens: list[int]):
        self.name, self.tokens = name, tokens
        self.asked, self.observed, self.committed = 0, [], []

    def start(self, seq):
        pass

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        self.asked += 1
        return [Draft([ctx.root, *self.tokens], list(range(-1, len(self.tokens))), source)]

    def observe(self, v):
        self.observed.append(v.last)

    def commit(self, tokens):
        self.committed.append(list(tokens))


def test_drafters_merge_by_priority_and_none_is_asked_once_the_width_is_full():
    names = ("quant", "ngram", "recycling")  # drafting order; merge priority: quant, ngram, recycling
    quant, ngram, recycling = Chain("quant", [3, 4, 5]), Chain("ngram", [6]), Chain("recycling", [7])
    drafting = Drafting(names)
    drafts = drafting.propose([quant, ngram, recycling], DraftContext(root=1, position=9, budget=4))
    assert [d.tokens for d in drafts] == [[1, 3, 4, 5]]  # the chain fills 4 nodes: the others are not asked
    assert (quant.asked, ngram.asked, recycling.asked) == (1, 0, 0)
    drafts = drafting.propose([quant, ngram, recycling], DraftContext(root=1, position=9, budget=6))
    assert [d.tokens for d in drafts] == [[1, 3, 4, 5], [1, 6], [1, 7]]  # room left: all asked, in priority order
    assert (quant.asked, ngram.asked, recycling.asked) == (2, 1, 1)
    assert drafting.coupled == [0]  # quant drafts with AR's own noise


def _logits_choosing(next_of: dict[int, int], tokens: torch.Tensor) -> torch.Tensor:
    logits = torch.zeros(tokens.shape[0], V)
    for row, t in enumerate(tokens.tolist()):
        logits[row, next_of.get(t, 0)] = 10.0
    return logits


class KV:
    def __init__(self):
        self.paths = []

    def commit(self, path):
        self.paths.append(path.tolist())


def test_accept_walks_commits_emits_teaches_and_records():
    params = SamplingParams(max_tokens=8)  # greedy
    st = Sequence([2, 1], params, [], vocab_size=V, eos_ids={15}, tokenizer=None, max_context=64, spare=8,
                  device=torch.device("cpu"))
    a, b = Chain("quant", [3, 4, 5]), Chain("recycling", [6])
    trie = build_trie(st.root, Drafting(("quant", "recycling")).propose([a, b], st.draft_context(6)), 6,
                      torch.device("cpu"))
    logits = _logits_choosing({1: 3, 3: 4, 4: 9}, trie.tokens)  # AR takes 3, 4, then 9 (not the drafted 5)
    stats, kv = GenStats(("quant", "recycling")), KV()
    nodes, emitted = accept(st, trie, logits, torch.zeros(trie.size, 4), kv, [a, b], stats, [], width=6,
                            learns_elsewhere=("recycling",))
    assert emitted == [3, 4, 9] and st.out == [3, 4, 9] and st.root == 9
    assert nodes == [1, 2]  # trie nodes of 3 and 4, beyond the root
    assert kv.paths == [[0, 1, 2]]  # the K/V of root, 3 and 4 are kept
    assert a.observed == [2] and b.observed == []  # recycling learns elsewhere (the batch's shared matrix)
    assert a.committed == b.committed == [[3, 4, 9]]
    d = stats.as_dict()
    assert d["steps"] == 1 and d["new_tokens"] == 3 and d["tokens_by_drafter"] == {"quant": 2, "recycling": 0}


def test_accept_stops_at_eos_and_commits_only_what_it_emits():
    params = SamplingParams(max_tokens=8)
    st = Sequence([2, 1], params, [], vocab_size=V, eos_ids={15}, tokenizer=None, max_context=64, spare=8,
                  device=torch.device("cpu"))
    a = Chain("quant", [15, 4])
    trie = build_trie(st.root, Drafting(("quant",)).propose([a], st.draft_context(4)), 4, torch.device("cpu"))
    logits = _logits_choosing({1: 15, 15: 4, 4: 5}, trie.tokens)
    kv = KV()
    _, emitted = accept(st, trie, logits, torch.zeros(trie.size, 4), kv, [a], GenStats(("quant",)), [], width=4)
    assert emitted == [15] and kv.paths == [[0]] and st.finished() == "eos"
