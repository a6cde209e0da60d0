"""Drafters behind one protocol: start a generation, propose trees under the root, learn from verify and commits.

Every drafter only proposes; verification decides, so no drafter can change the output (I1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specrun.decoding.drafters.ngram import NGramPool, SuffixCopy
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.verify.trie import Draft, DraftContext

# trie budget order: the 4-bit self-draft leads (AR's own picks under near-identical weights), then the recurrent
# drafter's best-first tree (it imitates AR's own pick, sampled text included), then n-grams (exact repeats)
MERGE_PRIORITY = ("quant", "recurrent", "ngram", "heads", "fused", "recycling")
NEEDS_HEADS = ("heads", "fused")
NEEDS_DRAFTER = ("recurrent",)  # a trained recurrent drafter (specrun train-drafter, or the one shipped for the model)
NEEDS_QUANT = ("quant",)  # a CPU model a 4-bit kernel takes, each sequence's K/V in one store (quant_draft.py)
DRAFTS_BY_FORWARD = ("heads", "quant")  # drafting is a forward of the model: no shadow tries (shadow.py)
NOISE_COUPLED = ("quant", "recurrent")  # draft with AR's own Gumbel noise (accepted beyond their drafted mass)
AUTO_DRAFTERS = ("quant", "heads", "recurrent", "ngram", "recycling")  # --draft auto: each where what it needs is there
COPY_NODES = 64  # the n-gram drafter's copied chain fills at most this many trie nodes (root included)


@dataclass(frozen=True)
class Verified:
    """One verify forward as drafters learn from it."""

    tokens: torch.Tensor  # [T] long, the trie's tokens
    logits: torch.Tensor  # [T, V]
    hidden: torch.Tensor  # [T, H] post-final-norm hidden states
    last: int  # trie node whose chosen next token is the new root (the last committed token)


class Drafter(Protocol):
    name: str

    def start(self, seq: list[int]) -> None: ...

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]: ...

    def observe(self, v: Verified) -> None: ...

    def commit(self, tokens: list[int]) -> None: ...


def _chain(tokens: list[int], source: int) -> Draft:
    return Draft(tokens, list(range(-1, len(tokens) - 1)), source)


class NGramDrafter:
    """TokenSwift token reutilization, led by a copy: first what followed the last earlier occurrence of the last 3
    committed tokens (prompt lookup, as long as the trie allows: a repeating passage is accepted whole), then the most
    frequent 3-token continuations as chains, keyed by a heads drafter's guess of the next token when there is one
    (root -> guess -> ...), else by the root. topk 0 turns both off.
    """

    name = "ngram"

    def __init__(self, topk: int):
        self.topk = topk
        self.pool = NGramPool(n=4, topk=max(topk, 1))
        self.copy = SuffixCopy(key=3)

    def start(self, seq: list[int]) -> None:
        self.pool.reset()
        self.pool.extend(seq)
        self.copy.reset()
        self.copy.extend(seq)

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        if self.topk == 0:
            return []
        head = [ctx.root] if ctx.guess is None else [ctx.root, ctx.guess]
        copied = self.copy.follow(min(ctx.budget, COPY_NODES) - 1)
        drafts = [_chain([ctx.root, *copied], source)] if copied else []
        return drafts + [_chain([*head, *c], source) for c in self.pool.query(head[-1], self.topk)]

    def observe(self, v: Verified) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        self.pool.extend(tokens)
        self.copy.extend(tokens)


class RecyclingDrafter:
    """Token Recycling: the static 80-node tree expanded from the adjacency matrix; state kept across prompts."""

    name = "recycling"

    def __init__(self, matrix: RecyclingMatrix):
        self.matrix = matrix

    def start(self, seq: list[int]) -> None:
        pass  # hot start: the matrix carries over from earlier prompts

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        tokens, parents = self.matrix.draft(ctx.root)
        return [Draft(tokens.tolist(), parents.tolist(), source)]

    def observe(self, v: Verified) -> None:
        self.matrix.learn_step(v.tokens, v.logits, plain=v.tokens.shape[0] == 1)

    def commit(self, tokens: list[int]) -> None:
        pass
