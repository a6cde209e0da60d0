"""Drafting with the target's own hidden state and trained heads: TokenSwift self-drafting, and fused drafting.

Candidates follow a static tree spec such as (1, 3, 3, 3): level j takes the top-k_j tokens of l_{j-1}, Cartesian.
"""

from __future__ import annotations

import itertools

import torch

from specrun.decoding.drafters.heads import DraftHeads
from specrun.decoding.drafters.partial_kv import PartialKV
from specrun.decoding.drafters.protocol import Verified
from specrun.decoding.forward.paged_runner import PagedRunner
from specrun.decoding.forward.solo_runner import SoloRunner
from specrun.decoding.verify.trie import Draft, DraftContext


class TreeTemplate:
    """A spec like (1, 3, 3, 3) turned once into parents and (level, rank) per node; node 0 is the root."""

    def __init__(self, spec: tuple[int, ...]):
        if not spec or any(k < 1 for k in spec):
            raise ValueError(f"tree spec {spec!r} needs one or more positive widths, e.g. 1,3,3,3")
        self.spec = spec
        parents, levels, ranks = [-1], [0], [0]
        frontier = [0]
        for depth, width in enumerate(spec, start=1):
            nxt = []
            for p, r in itertools.product(frontier, range(width)):
                parents.append(p)
                levels.append(depth)
                ranks.append(r)
                nxt.append(len(parents) - 1)
            frontier = nxt
        self.parents = parents
        self.level = torch.tensor(levels[1:]) - 1  # which logits row (l_0, l_1, ...) each non-root node reads
        self.rank = torch.tensor(ranks[1:])
        self.kmax = max(spec)

    def fill(self, root: int, logits: torch.Tensor) -> list[int]:
        """# logits: [>=len(spec), V] (l_0, l_1, ...) -> tokens of every node, root first"""
        top = torch.topk(logits[: len(self.spec)], self.kmax, dim=-1).indices  # [levels, kmax]
        return [root, *top[self.level, self.rank].tolist()]


def _check_depth(tree: tuple[int, ...], heads: DraftHeads) -> None:
    if len(tree) > heads.gamma + 1:
        raise ValueError(f"tree {tree} is {len(tree)} levels deep but {heads.gamma} heads give {heads.gamma + 1}")


class SelfDrafter:
    """One sequence's self-drafter (TokenSwift): the tree template over l_0..l_gamma and its partial cache, which
    indexes its own K/V and ranks slots by the query rows of the last committed token (from the last forward that
    captured them); draft_batch runs one draft forward for every drafting sequence and hands each its logits."""

    name = "heads"

    def __init__(self, heads: DraftHeads, tree: tuple[int, ...], kv: PartialKV):
        _check_depth(tree, heads)
        self.heads, self.kv = heads, kv
        self.template = TreeTemplate(tree)
        self.logits: torch.Tensor | None = None  # [gamma+1, V] of this step, from draft_batch
        self._queries: list[torch.Tensor] = []  # per layer q [rows, Hq, D]
        self._offset = 0  # its first row in the verify forward's packed rows
        self._row = -1  # the last committed token's row in them

    @property
    def needs_queries(self) -> bool:
        return self.kv.mode != "full"

    def start(self, seq: list[int]) -> None:
        self.kv.reset()
        self._row = -1  # prefill's last token

    def commit(self, tokens: list[int]) -> None:
        pass

    def see_queries(self, queries: list[torch.Tensor], offset: int) -> None:
        """The forward that just ran (a verify, or prefill with offset -1 for its last row) captured these."""
        self._queries, self._offset = queries, offset

    def observe(self, v: Verified) -> None:
        self._row = self._offset + v.last

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        """# self.logits: [gamma+1, V] l_0 (the root's next token) and the heads' l_1..l_gamma"""
        if self.logits is None:
            return []
        tokens = self.template.fill(ctx.root, self.logits)
        self.logits = None
        ctx.guess = tokens[1]
        return [Draft(tokens, self.template.parents, source)]

    def last_query(self) -> torch.Tensor:
        """# -> [Lyr, Hq, D] query of the last committed token, per layer"""
        return torch.stack([q[self._row] for q in self._queries])


def draft_batch(runner: PagedRunner | SoloRunner, heads: DraftHeads, entries: list) -> None:
    """One draft forward for every self-drafting sequence: its root at its position, over its partial cache; sets
    each drafter's logits (l_0, l_1..l_gamma). entries: (its K/V, its SelfDrafter, root, position) per sequence."""
    dev = runner.lm.device
    one = torch.ones((1, 1), dtype=torch.bool, device=dev)
    selects = [d.kv.refresh(pages, d.last_query) for pages, d, _, _ in entries]
    # each root's K/V land in its first free slot, which the verify forward overwrites: scratch, never committed
    h0 = runner.forward([e[0] for e in entries], [torch.tensor([e[2]], device=dev) for e in entries],
                        [torch.tensor([e[3]], device=dev) for e in entries], [one] * len(entries), selects=selects)
    with torch.inference_mode():
        logits = torch.empty((heads.gamma + 1, h0.shape[0], runner.lm_head.weight.shape[0]), device=dev)
        logits[0] = runner.logits(h0)
        logits[1:] = heads.logits(h0, runner.lm_head)
    for i, (_, d, _, _) in enumerate(entries):
        d.logits = logits[:, i]


class FusedDrafter:
    """The heads on the verify forward's hidden state of the node before the root: no draft forward at all.

    That node's l_0 chose the root exactly, so its heads l_1..l_gamma guess the tokens after the root; the tree
    spec's levels 2.. size those guesses (the self-drafter's l_0 level has no counterpart here).
    """

    name = "fused"

    def __init__(self, heads: DraftHeads, lm_head: torch.nn.Module, tree: tuple[int, ...]):
        if len(tree) < 2:
            raise ValueError(f"tree {tree} has no level for the heads: fused drafting needs two or more levels")
        _check_depth(tree, heads)
        self.heads, self.lm_head = heads, lm_head
        self.template = TreeTemplate(tree[1:])
        self._h: torch.Tensor | None = None  # [H] hidden state of the node that chose the current root

    def start(self, seq: list[int]) -> None:
        self._h = None  # the first step after a prefill drafts nothing: prefill keeps no hidden state

    def observe(self, v: Verified) -> None:
        self._h = v.hidden[v.last]

    def commit(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        if self._h is None:
            return []
        with torch.inference_mode():
            logits = self.heads.logits(self._h[None], self.lm_head)[:, 0]  # [gamma, V]: l_1..l_gamma
        tokens = self.template.fill(ctx.root, logits.float())
        # no ctx.guess: l_1 is far less sure than the self-drafter's l_0, and a wrong guess would derail the n-grams
        return [Draft(tokens, self.template.parents, source)]
