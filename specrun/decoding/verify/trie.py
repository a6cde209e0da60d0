"""Token trie rooted at the last committed token: merge drafts, derive mask/positions, walk the target's choices.

Nodes are in insertion order with parents before children; identical prefixes are one node; a budget caps the size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specrun.decoding.kernels.cpu_kernels import argmax_rows


@dataclass(frozen=True)
class Draft:
    """A drafter's proposal: a tree under the root (node 0 = root, parent -1), parents before children."""

    tokens: list[int]
    parents: list[int]
    source: int  # drafter id, for per-drafter stats


@dataclass
class DraftContext:
    """What drafters see in one step; the self-drafter fills `guess` (its l_0 top-1) for those after it."""

    root: int  # last committed token, K/V not yet cached
    position: int  # the root's absolute position
    guess: int | None = None
    budget: int = 1 << 30  # most trie nodes this step (root included)
    params: object | None = None  # the sequence's SamplingParams (drafters that imitate AR's choice read them)
    present: torch.Tensor | None = None  # [V] bool, tokens in the committed penalty window (None: no penalty)


@dataclass(frozen=True)
class Trie:
    tokens: torch.Tensor  # [T] long
    parents: torch.Tensor  # [T] long, -1 at the root
    depths: torch.Tensor  # [T] long, 0 at the root
    ancestors: torch.Tensor  # [T, T] bool, ancestor-or-self (the tree attention mask)
    path_tokens: torch.Tensor  # [T, Dm] long: tokens at depths 1..d of each node's path, -1 padded
    sources: torch.Tensor  # [T] long: drafter that first proposed the node (-1 root)
    levels: tuple[torch.Tensor, ...]  # node indices per depth 1..Dm

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def merge_drafts(root: int, drafts: list[Draft], budget: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Merge drafts in priority order into one trie of at most `budget` nodes (root included).

    Returns parallel lists (tokens, parents, depths, sources).
    """
    tokens, parents, depths, sources = [root], [-1], [0], [-1]
    index: dict[tuple[int, int], int] = {}
    for d in drafts:
        local = [0] * len(d.tokens)  # draft node -> trie node
        for i in range(1, len(d.tokens)):
            p = local[d.parents[i]]
            if p < 0:  # parent was cut by the budget
                local[i] = -1
                continue
            key = (p, d.tokens[i])
            node = index.get(key)
            if node is None:
                if len(tokens) >= budget:
                    local[i] = -1
                    continue
                node = len(tokens)
                index[key] = node
                tokens.append(d.tokens[i])
                parents.append(p)
                depths.append(depths[p] + 1)
                sources.append(d.source)
            local[i] = node
    return tokens, parents, depths, sources


def build_trie(root: int, drafts: list[Draft], budget: int, device: torch.device) -> Trie:
    tok, par, dep, src = merge_drafts(root, drafts, budget)
    T, Dm = len(tok), max(dep)
    # node by node in numpy rows (parents before children), then a tensor each: torch ops a depth cost more
    ancestors, paths = np.zeros((T, T), dtype=bool), np.full((T, Dm), -1, dtype=np.int64)
    levels: list[list[int]] = [[] for _ in range(Dm)]
    ancestors[0, 0] = True
    for i in range(1, T):
        p, d = par[i], dep[i]
        ancestors[i] = ancestors[p]
        ancestors[i, i] = True
        paths[i] = paths[p]
        paths[i, d - 1] = tok[i]
        levels[d - 1].append(i)

    def longs(x) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return Trie(longs(tok), longs(par), longs(dep), torch.from_numpy(ancestors).to(device),
                torch.from_numpy(paths).to(device), longs(src), tuple(longs(level) for level in levels))


def walk(trie: Trie, choice: torch.Tensor) -> torch.Tensor:
    """Follow the child whose token equals the parent's target choice, from the root.

    # choice: [T] long, the target's token after each node -> [A] long node indices of the accepted path
    """
    if choice.device.type == "cpu":  # node by node in Python integers: ~4 torch ops a depth cost more on the CPU
        want, ok = choice.tolist(), [True]
        for token, parent in zip(trie.tokens.tolist()[1:], trie.parents.tolist()[1:]):  # parents before children
            ok.append(ok[parent] and token == want[parent])
        return torch.tensor([node for node, yes in enumerate(ok) if yes], dtype=torch.long)
    return walk_levels(trie, choice)


def walk_levels(trie: Trie, choice: torch.Tensor) -> torch.Tensor:
    """walk() a depth at a time in tensor ops (an accelerator's tensors stay where they are)."""
    accepted = torch.zeros(trie.size, dtype=torch.bool, device=choice.device)
    accepted[0] = True
    for idx in trie.levels:
        par = trie.parents[idx]
        accepted[idx] = accepted[par] & (trie.tokens[idx] == choice[par])
    # siblings are distinct, so the accepted nodes form one chain; index order is depth order
    return accepted.nonzero().squeeze(1)


def coupled(trie: Trie, sources: list[int]) -> bool:
    """Does any node come from one of these drafters (those that draft with AR's own noise)?"""
    return bool(sources) and bool(torch.isin(trie.sources, torch.tensor(sources, device=trie.sources.device)).any())


def drafted_mass(trie: Trie, processed: torch.Tensor, path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per node on the accepted path that has drafted children: the probability that AR's sampled token is one of
    them (softmax of the processed logits summed over the children's tokens) and whether the path went on (1/0).

    Expected and observed acceptance must agree on average for sampled text (a gap means biased verification).
    # processed: [T, V], path: [A] long -> expected: [N] float, observed: [N] float (N <= A)
    """
    children = trie.parents[None, :] == path[:, None]  # [A, T]
    has = children.any(dim=1)
    went_on = torch.ones_like(has)
    went_on[-1] = False  # the last path node's choice matched none of its children
    probs = processed[path[has]].softmax(dim=-1)  # [N, V]
    mass = (probs[:, trie.tokens] * children[has]).sum(dim=1)  # [N]
    return mass, went_on[has].to(mass.dtype)


def likeliest(processed: torch.Tensor, choice: torch.Tensor, path: torch.Tensor) -> list[bool]:
    """Per node on the accepted path: was AR's sampled token its row's most likely one (what an oracle drafts).

    # processed: [T, V], choice: [T] long, path: [A] long -> [A] bools
    """
    return (argmax_rows(processed)[path] == choice[path]).tolist()  # every row: no copy of the path's rows


def record_sampled(stats, trie: Trie, processed: torch.Tensor, choice: torch.Tensor, path: torch.Tensor, emitted: int,
                   coupled_sources: list[int]) -> None:
    """A sampled step's checks into its GenStats: drafted mass against acceptance (left out for tries drafted with
    AR's own noise, accepted beyond their mass by design) and the likeliest-chain oracle over the `emitted` tokens."""
    if trie.size > 1 and not coupled(trie, coupled_sources):
        stats.record_acceptance(*drafted_mass(trie, processed, path))
    stats.record_likeliest(likeliest(processed, choice, path)[:emitted])
