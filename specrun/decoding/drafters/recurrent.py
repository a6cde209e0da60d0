"""Recurrent drafter (ReDrafter/EAGLE-like): s_1 = g(h, e(root)), s_{j+1} = g(s_j, e(x_j)), q_j = LM head rows(s_j).

It drafts from the verify forward's hidden state (no draft forward of the target) and samples its tree with the
same position-keyed Gumbel noise as AR (docs/design.md section 3): where q is close to the target, its pick is AR's
pick.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specrun.decoding.forward.linear import Linear
from specrun.decoding.kernels.cpu_kernels import TOPK_MAX, cpu_kernels
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sampling import FEW_PAIRS, gumbel_at, kernel_sampling, process_logits
from specrun.decoding.verify.trie import Draft, DraftContext

DEFAULT_SHAPE = (4, 2, 2, 1, 1)  # children per node at depths 1..5 (60 nodes); nodes are ordered best-first


class RecurrentDraft(nn.Module):
    """g(s, e) = s + down(silu(up([norm_s(s), norm_e(e)]))); vocab_ids: the tokens it drafts (a frequent subset).

    Untrained (down = 0) it repeats the target's state, so every level guesses with the root's own l_0.
    """

    def __init__(self, hidden_size: int, ffn_size: int, vocab_ids: torch.Tensor, eps: float = 1e-6):
        super().__init__()
        if hidden_size < 1 or ffn_size < 1:
            raise ValueError(f"hidden_size and ffn_size must be >= 1, got {hidden_size}, {ffn_size}")
        if vocab_ids.dim() != 1 or vocab_ids.numel() < 1:
            raise ValueError(f"vocab_ids must be a non-empty 1-D tensor, got shape {tuple(vocab_ids.shape)}")
        self.hidden_size, self.ffn_size, self.eps = int(hidden_size), int(ffn_size), float(eps)
        self.norm_s = nn.RMSNorm(hidden_size, eps=eps)
        self.norm_e = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(2 * hidden_size, ffn_size, bias=False)
        self.down = nn.Linear(ffn_size, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)
        self.register_buffer("vocab_ids", vocab_ids.to(torch.long).clone())

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """# s: [..., H] state (s_0 = the target's post-norm hidden), e: [..., H] next token's embedding -> [..., H]"""
        return _g(self, self.up, self.down, s, e)

    def config(self) -> dict:
        return {"hidden_size": self.hidden_size, "ffn_size": self.ffn_size, "eps": self.eps,
                "n_vocab": int(self.vocab_ids.numel())}


def _g(drafter: RecurrentDraft, up, down, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The drafter's step with its norms and these up/down maps (its own modules, or prepacked copies of them)."""
    return s + down(F.silu(up(torch.cat([drafter.norm_s(s), drafter.norm_e(e)], dim=-1))))


class DraftWeights:
    """What drafting reads, prepared once per model: the drafter, the embedding, and the LM head rows of its vocab.

    step() is the drafter's g with prepacked up/down matrices: on smollm2's drafter a level's g took 246 us through the
    nn.Module (bf16 F.linear reorders its weights at every call), 171 us prepacked.
    """

    def __init__(self, drafter: RecurrentDraft, embed: nn.Module, lm_head: nn.Module):
        self.drafter, self.embed = drafter, embed
        self.vocab_ids = drafter.vocab_ids  # [N]
        self.head = Linear(lm_head.weight.detach()[self.vocab_ids].contiguous())  # [N, H]: one small GEMV per level
        self.up, self.down = Linear(drafter.up.weight.detach()), Linear(drafter.down.weight.detach())

    @torch.inference_mode()
    def step(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """RecurrentDraft.forward with the prepacked matrices. # s, e: [R, H] -> [R, H]"""
        return _g(self.drafter, self.up, self.down, s, e)

    @torch.inference_mode()
    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """# s: [R, H] -> [R, N] float32 logits over vocab_ids"""
        return self.head(s.to(self.head.weight.dtype)).float()


def noise_row(w: DraftWeights, seed: int, position: int) -> torch.Tensor:
    """AR's Gumbel noise at `position` for the drafter's vocabulary. -> [N] float32"""
    return gumbel_at(seed, torch.full_like(w.vocab_ids, position), w.vocab_ids).float()


def _processed(w: DraftWeights, z: torch.Tensor, params: SamplingParams, present: torch.Tensor | None,
               position: int, noise=noise_row) -> torch.Tensor:
    """The drafter's guess of AR's scores at `position` from its logits: AR's processing (penalty from the committed
    window), then the position's own Gumbel noise when sampling.
    # z: [R, N] float32 (w.logits), present: [N] bool over the drafter's vocabulary, or None -> scores [R, N]
    # (-inf = dropped)"""
    pres = present[None].expand_as(z) if present is not None else None
    scores = process_logits(z, pres, params)
    if not params.greedy:
        _add_noise(w, scores, params.seed, position, noise)
    return scores


def _children(w: DraftWeights, s: torch.Tensor, params: SamplingParams, present: torch.Tensor | None, position: int,
              k: int, noise=noise_row) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_top_children(_processed(...), k) (k capped at the drafter's vocabulary), in one call of our kernel where it takes
    the settings (temperature with min-p: sampling.kernel_sampling): a level's ~25 torch ops took 0.5-0.7 ms.
    # s: [R, H] -> values, columns, probabilities: [R, k] each"""
    z = w.logits(s)  # [R, N]
    k = min(k, z.shape[1])
    if k <= TOPK_MAX and kernel_sampling(params, z):
        got = cpu_kernels().draft_level(z, present if params.uses_penalty else None, w.vocab_ids, params.penalty,
                                        params.temperature, params.min_p, params.seed, position, k)
        if got is not None:  # else a NaN: torch's path below
            val, idx, lse = got
            return val, idx, _chances(val, lse)
    return _top_children(_processed(w, z, params, present, position, noise), k)


def _add_noise(w: DraftWeights, scores: torch.Tensor, seed: int, position: int, noise) -> None:
    """scores += the position's Gumbel row, in place. Where truncation (min-p, top-k, top-p) kept few tokens, only
    theirs is computed (the same values): a whole row over the drafter's 8,192 tokens took ~0.9 ms, a fifth of a
    drafted tree on smollm2. # scores: [R, N] float, -inf = dropped"""
    rows, cols = torch.isfinite(scores).nonzero(as_tuple=True)  # [K] each
    if rows.numel() <= FEW_PAIRS:
        uniq, inverse = torch.unique(cols, return_inverse=True)  # rows share the position: one draw per kept token
        g = gumbel_at(seed, torch.full_like(uniq, position), w.vocab_ids[uniq])
        scores[rows, cols] += g.to(scores.dtype)[inverse]
    else:
        scores += noise(w, seed, position).to(scores.dtype)[None]


def _top_children(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's k best columns and the chance the drafter gives each of being AR's pick: with the noise in, AR's
    scores are the drafter's plus its error, so softmax(scores) estimates it (the coupled argmax is the likeliest by
    far where the drafter is close). # scores: [R, N] -> values, columns, probabilities: [R, k] each"""
    val, idx = torch.topk(scores, k, dim=-1)
    return val, idx, _chances(val, torch.logsumexp(scores, dim=-1))


def _chances(val: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """softmax probabilities of the values, 0 where undefined (a NaN would break the best-first order).
    # val: [R, k], lse: [R] each row's logsumexp -> [R, k]"""
    return (val - lse[:, None]).exp().nan_to_num(0.0)


@torch.inference_mode()
def draft_tree(w: DraftWeights, h: torch.Tensor, root: int, position: int, params: SamplingParams,
               present: torch.Tensor | None, shape: tuple[int, ...], max_nodes: int,
               noise=noise_row) -> tuple[list[int], list[int]]:
    """A tree under the root: at depth d each node's children are its top shape[d-1] guesses of AR's token at
    position+d. Nodes come best-first (by the drafter's probability of the whole path), at most max_nodes.

    # h: [H] the target's hidden state that chose the root -> (tokens, parents) with the root first (parent -1)
    """
    depth = min(len(shape), max_nodes)
    if depth < 1:
        return [root], [-1]
    present = present[w.vocab_ids] if present is not None else None  # [N]: the committed window's, for every level
    s = h[None].to(w.up.weight.dtype)  # [R, H], R = frontier rows
    x = torch.tensor([root], dtype=torch.long, device=h.device)  # [R] the frontier's tokens
    mass, parents, tokens = [1.0], [-1], [root]  # mass: the drafter's probability of the node's whole path
    frontier = [0]  # node index of each frontier row
    for d in range(1, depth + 1):
        s = w.step(s, w.embed(x).to(s.dtype))  # [R, H]
        val, idx, prob = _children(w, s, params, present, position + d, shape[d - 1], noise)  # [R, k] each
        k = val.shape[1]
        keep = (val > float("-inf")).flatten().nonzero().squeeze(1)  # [C] children that truncation allows
        if keep.numel() == 0:
            break
        cols = idx.flatten()[keep]  # [C] the kept children's columns in the drafter's vocabulary
        x = w.vocab_ids[cols]  # [C] the next frontier's tokens
        rows = keep // k
        p_child = prob.flatten()[keep].tolist()
        nxt = []
        for j, tok, pc in zip(keep.tolist(), x.tolist(), p_child):
            p = frontier[j // k]
            mass.append(mass[p] * pc)
            parents.append(p)
            tokens.append(tok)
            nxt.append(len(tokens) - 1)
        # a child outside the best max_nodes nodes so far stays out, and so do its descendants (no more mass, created
        # later): only the others are expanded, so a level runs at most max_nodes rows
        best = set(_best_first(mass, max_nodes))
        alive = [c for c, node in enumerate(nxt) if node in best]
        if not alive:
            break
        sel = torch.tensor(alive, dtype=torch.long, device=h.device)
        s, x, frontier = s[rows[sel]], x[sel], [nxt[c] for c in alive]
    order = _best_first(mass, max_nodes)
    new = {0: 0, **{old: i + 1 for i, old in enumerate(order)}}
    return [root, *(tokens[i] for i in order)], [-1, *(new[parents[i]] for i in order)]


def _best_first(mass: list[float], n: int) -> list[int]:
    """The n nodes (root excluded) of the largest path mass, best first. A child's mass never exceeds its parent's,
    and ties keep creation order: parents stay before children."""
    return sorted(range(1, len(mass)), key=lambda i: -mass[i])[:n]


class RecurrentDrafter:
    """One sequence's recurrent drafter: reads the hidden state of the verify node that chose the root."""

    name = "recurrent"

    def __init__(self, weights: DraftWeights, shape: tuple[int, ...] = DEFAULT_SHAPE):
        self.weights, self.shape = weights, shape
        self._h: torch.Tensor | None = None  # [H]
        self._noise: dict[int, torch.Tensor] = {}  # position -> its noise row: each is drafted at several steps

    def start(self, seq: list[int]) -> None:
        self._h = None  # prefill keeps no hidden state: the first step drafts nothing
        self._noise.clear()

    def _noise_row(self, w: DraftWeights, seed: int, position: int) -> torch.Tensor:
        row = self._noise.get(position)
        if row is None:
            row = self._noise[position] = noise_row(w, seed, position)
        return row

    def observe(self, v) -> None:
        self._h = v.hidden[v.last]

    def commit(self, tokens: list[int]) -> None:
        pass

    def propose(self, ctx: DraftContext, source: int) -> list[Draft]:
        if self._h is None or ctx.params is None:
            return []
        for p in [p for p in self._noise if p <= ctx.position]:  # positions behind the root are never drafted again
            del self._noise[p]
        tokens, parents = draft_tree(self.weights, self._h, ctx.root, ctx.position, ctx.params, ctx.present,
                                     self.shape, ctx.budget - 1, self._noise_row)
        return [Draft(tokens, parents, source)] if len(tokens) > 1 else []
