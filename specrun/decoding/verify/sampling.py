"""Position-keyed sampling: one code path turns logits into tokens for AR steps and trie verification.

Noise depends only on (seed, absolute position, token id), so every trie node at a given depth uses the row AR would.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from specrun.decoding.kernels.cpu_kernels import Patches, argmax_rows, cpu_kernels, row_kernels
from specrun.decoding.verify.params import SamplingParams

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    # exact (x * c) mod 2**32 in int64 without overflow: split c into 16-bit halves (int64 tensors or Python ints)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _M32


def _mix32(x):
    # lowbias32 finalizer (Wellons): a bijection on uint32 with good avalanche (int64 tensors or Python ints)
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _key_bits(seed: int, positions):
    s_lo, s_hi = seed & _M32, (seed >> 32) & _M32
    return _mix32(_mix32(positions ^ s_lo) ^ s_hi)


def _bits(key, v):
    """Two 32-bit draws for (position key, token id) pairs (int64 tensors or Python ints): the 53-bit uniform's halves."""
    h = _mix32(_mix32(key ^ _mix32(v + 0x9E3779B9)) + 0x632BE5AB)
    # a second independent 32-bit draw gives a 53-bit uniform so the Gumbel tail is not clipped early
    return h, _mix32(h ^ 0x5BD1E995)


def _key(seed: int, positions: torch.Tensor) -> torch.Tensor:
    return _key_bits(seed, positions.to(torch.int64))


def _gumbel_of_bits(h: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) from _bits' two int64 draws -> float64"""
    u = ((h >> 5).to(torch.float64) * 67108864.0 + (h2 >> 6).to(torch.float64) + 0.5) / 9007199254740992.0
    return -torch.log(-torch.log(u))


def _gumbel(key: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Noise for (position key, token id) pairs, elementwise after broadcasting -> float64"""
    return _gumbel_of_bits(*_bits(key, v))


def gumbel_noise(seed: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise, identical on every device.

    # positions: [R] absolute positions of the tokens being sampled -> [R, V] float64
    """
    v = torch.arange(vocab_size, device=positions.device, dtype=torch.int64)
    return _gumbel(_key(seed, positions)[:, None], v[None, :])


FEW_PAIRS = 256  # up to this many pairs gumbel_at hashes in Python integers: ~30 tensor ops cost ~0.4 ms, whatever N


def gumbel_at(seed: int, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The same noise at single (position, token) pairs. # positions, tokens: [N] -> [N] float64"""
    if positions.numel() > FEW_PAIRS:
        return _gumbel(_key(seed, positions), tokens.to(torch.int64))
    bits = [_bits(_key_bits(seed, p), t) for p, t in zip(positions.tolist(), tokens.tolist())]
    h, h2 = torch.tensor(bits, dtype=torch.int64, device=positions.device).reshape(-1, 2).unbind(1)
    return _gumbel_of_bits(h, h2)


def apply_penalty(logits: torch.Tensor, present: torch.Tensor, theta: float) -> torch.Tensor:
    """Contextual penalty: logit/theta if > 0 else logit*theta, for tokens present in the window.

    Only the window's tokens (a few hundred of the vocabulary) are touched: the same values as a whole-row pass.
    # logits: [T, V] float, present: [T, V] bool -> [T, V] (a new tensor)
    """
    rows, cols = present.nonzero(as_tuple=True)
    hit = logits[rows, cols]
    out = logits.clone()
    out[rows, cols] = torch.where(hit > 0, hit / theta, hit * theta)
    return out


def truncate(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Top-k, top-p, min-p, eta in that order, each on what the previous one kept (HF warper semantics).

    # scores: [T, V] temperature-scaled logits -> [T, V] with -inf outside the kept set
    """
    neg_inf = float("-inf")
    if p.top_k > 0 and p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if p.top_p < 1.0:
        sorted_s, order = torch.sort(scores, dim=-1, descending=False)
        cum = sorted_s.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - p.top_p)
        drop_sorted[:, -1] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, neg_inf)
    if p.min_p > 0.0:  # probability < min_p * the top one's, stated on the scores (as our kernel computes it)
        floor = scores.amax(dim=-1, keepdim=True) + math.log(p.min_p)
        scores = scores.masked_fill(scores < floor, neg_inf)
    if p.eta > 0.0:
        probs = scores.softmax(dim=-1)
        entropy = -(probs * torch.log(probs.clamp_min(1e-300))).sum(dim=-1, keepdim=True)
        eps = torch.minimum(torch.full_like(entropy, p.eta), math.sqrt(p.eta) * torch.exp(-entropy))
        top = scores.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill((probs < eps) & (scores < top), neg_inf)
    return scores


def process_logits(logits: torch.Tensor, present: torch.Tensor | None, p: SamplingParams) -> torch.Tensor:
    """Penalty, temperature, truncation: the distribution AR samples from (softmax of the result).

    # logits: [T, V], present: [T, V] bool or None -> [T, V] float32/float64
    """
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    if present is not None and p.uses_penalty:
        x = apply_penalty(x, present, p.penalty)
    if p.greedy:
        return x
    return truncate(x / p.temperature if p.temperature != 1.0 else x, p)  # x / 1.0 is x: one pass saved


def choose(processed: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """Gumbel-max over processed logits; plain argmax when greedy (noise is None).

    # processed: [T, V], noise: [T, V] float64 or None -> [T] long
    """
    if noise is None:
        return argmax_rows(processed)
    return argmax_rows(processed + noise.to(processed.dtype))


def sample(processed: torch.Tensor, seed: int, positions: torch.Tensor, ids: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Gumbel-max for rows sampled at the given absolute positions; the same tokens as choose() with full noise rows.
    ids: the token each column stands for (a draft's candidates; the rest of the vocabulary dropped), else column j is
    token j.

    Truncation (top-k/top-p/min-p/eta) usually keeps a handful of tokens: noise is then drawn for those alone.
    # processed: [T, V] (-inf = dropped), positions: [T] long, ids: [T, V] long -> [T] long (token ids)
    """
    T, V = processed.shape
    rows, cols = (processed > float("-inf")).nonzero(as_tuple=True)  # row-major: each row's columns ascending
    if ids is None and rows.numel() * 4 > processed.numel():  # little truncated: whole noise rows, one per position
        uniq, inverse = torch.unique(positions, return_inverse=True)
        return choose(processed, gumbel_noise(seed, uniq, V)[inverse])
    # argmax over the kept entries alone (the dropped ones are -inf), the first token among equals as argmax picks
    tokens = cols if ids is None else ids[rows, cols]
    none = V if ids is None else torch.iinfo(ids.dtype).max  # a row with nothing kept
    scores = processed[rows, cols] + gumbel_at(seed, positions[rows], tokens).to(processed.dtype)  # [N]
    best = scores.new_full((T,), float("-inf")).scatter_reduce_(0, rows, scores, "amax")  # [T]
    firsts = torch.where(scores == best[rows], tokens, none)
    picked = tokens.new_full((T,), none).scatter_reduce_(0, rows, firsts, "amin")
    return picked.masked_fill_(picked == none, 0)  # a row with nothing kept (NaN logits): token 0, as argmax gives


def kernel_sampling(p: SamplingParams, logits: torch.Tensor) -> bool:
    """Whether sample_in_kernel takes these settings and logits: temperature with min-p (the cut keeps the kernel's
    scalar noise to a few tokens a row; without it torch's whole-row noise is vectorised), the penalty or not, no top-k,
    top-p or eta; CPU float32 rows where our kernels load."""
    return not p.greedy and p.min_p > 0.0 and not p.top_k and p.top_p == 1.0 and p.eta == 0.0 \
        and row_kernels(logits) is not None


def ar_choice(logits: torch.Tensor, p: SamplingParams, positions: torch.Tensor,
              kernel_inputs: Callable[[], tuple[torch.Tensor | None, Patches | None]],
              presence: Callable[[], torch.Tensor | None], ids: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """AR's token for each row of logits at its position, and the processed rows: our kernel where it takes them
    (kernel_inputs() -> its counts and patches), else process_logits with presence() then argmax or Gumbel-max.
    ids: the token of each column, ascending (a draft's candidates: the first token among equals as over the
    vocabulary; torch's path), else column j is token j. The inputs are callables: each path builds only its own.
    # logits: [T, V], positions: [T] long, ids: [T, V] long -> [T] token ids, [T, V]"""
    if ids is None and kernel_sampling(p, logits):
        done = sample_in_kernel(logits, *kernel_inputs(), p, positions)
        if done is not None:
            return done
    processed = process_logits(logits, presence(), p)
    if not p.greedy:
        return sample(processed, p.seed, positions, ids), processed
    best = choose(processed, None)
    return (best if ids is None else ids.gather(1, best[:, None])[:, 0]), processed


def sample_in_kernel(logits: torch.Tensor, counts: torch.Tensor | None, patches: Patches | None, p: SamplingParams,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sample(processed, p.seed, positions), processed) for processed = process_logits(logits, presence, p), in one
    pass a row of our CPU kernel where kernel_sampling(p, logits); None if a row has a NaN (then the torch path). The
    presence is counts > 0 but for the patches (rows, cols, present). 23 us a 49,152-wide row where torch's ~30 small
    ops took 444.

    # logits: [T, V], counts: [V] int32 or None, positions: [T] long -> ([T] long, [T, V])
    """
    T = logits.shape[0]
    return sample_rows_in_kernel(logits, [counts] * T, patches, [p] * T, positions)


def kernel_group(p: SamplingParams) -> tuple[float, float, float]:
    """What rows sampled in one sample_rows_in_kernel call share: the penalty, temperature and min-p (not the seed)."""
    return p.penalty, p.temperature, p.min_p


def sample_rows_in_kernel(logits: torch.Tensor, counts: list, patches: Patches | None, params: list[SamplingParams],
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """sample_in_kernel for rows of several sequences in one call: row t under params[t] (all of one kernel_group,
    each its own seed) and counts[t] ([V] int32, or None: no penalty); the patches' rows index these rows. None if a
    row has a NaN. # logits: [T, V], positions: [T] long -> ([T] long, [T, V])"""
    p = params[0]
    each = [c if q.uses_penalty else None for c, q in zip(counts, params)]
    return cpu_kernels().sample_minp(logits, each, patches, p.penalty, p.temperature, p.min_p, [q.seed for q in params],
                                     positions)
