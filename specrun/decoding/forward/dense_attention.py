"""The `dense` batched attention: every sequence held on one page attends in one batched matmul over the pool in place.

Keys are padded to the longest and masked, rows to the widest trie: exact up to rounding (the CPU default in bf16/fp16,
where the per-sequence path's many small calls cost ~2x); paged_attention.py's `sdpa` stays the bit-exact reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specrun.decoding.forward.plan import BatchPlan

DENSE_BUCKET = 64  # keys padded to a multiple of this: a bf16 matmul of a new shape costs ~0.5 ms of oneDNN set-up
DENSE_MAX_SCORES = 64 << 20  # bytes of float32 scores per layer above which the per-sequence path runs instead


@dataclass(frozen=True)
class Dense:
    """A forward's sequences attended together: pages [lo, lo + Pb) as one batch, T rows each, S keys."""

    lo: int
    Pb: int
    T: int  # rows per page: the widest of these sequences' new tokens (the others' extra rows are padding)
    S: int  # keys of the longest, bucketed; the others' extra keys are masked
    slots: torch.Tensor  # [n] long: each of their query rows' place in the padded [Pb * T] rows
    rows: torch.Tensor  # [n] long: the query row itself
    bias: torch.Tensor  # [Pb, 1, S, 1] float32: 0 for a key its page's sequence holds, -inf beyond
    hidden: tuple  # (page, key, column) index tensors of the tree-masked scores (columns g*T + t)
    members: frozenset  # their sequence indices in the plan


def dense_rows(plan: BatchPlan, n_kv: int, G: int, device) -> Dense | None:
    """Plan `dense` over the sequences with every key on one page; None when fewer than two (one sdpa call is cheaper
    then) or when the float32 scores would pass DENSE_MAX_SCORES (long contexts keep the flash kernel)."""
    idx = [i for i in range(plan.batch_size) if plan.pages(i).shape[0] == 1]
    if len(idx) < 2:
        return None
    pages = [int(plan.pages(i)[0]) for i in idx]
    lens = [plan.kv_len(i) for i in idx]
    lo, T = min(pages), max(plan.qo_len(i) for i in idx)
    Pb, S = max(pages) - lo + 1, min(plan.page_size, -(-max(lens) // DENSE_BUCKET) * DENSE_BUCKET)
    if Pb * n_kv * S * G * T * 4 > DENSE_MAX_SCORES:
        return None
    seen = torch.zeros((Pb, S), dtype=torch.bool)
    seen[:, 0] = True  # pages outside the forward (free, or another kind of sequence): one key keeps softmax finite
    seen[torch.tensor(pages) - lo] = torch.arange(S)[None] < torch.tensor(lens)[:, None]
    bias = torch.zeros((Pb, S), dtype=torch.float32).masked_fill_(~seen, float("-inf"))[:, None, :, None]
    slots, rows, hidden = [], [], []
    for i, page, n in zip(idx, pages, lens):
        Ti, a = plan.qo_len(i), int(plan.qo_indptr[i])
        slots.append(torch.arange((page - lo) * T, (page - lo) * T + Ti))
        rows.append(torch.arange(a, a + Ti))
        t, j = (~plan.tree_masks[i]).nonzero(as_tuple=True)  # row t does not see new token j
        cols = (torch.arange(G)[:, None] * T + t[None]).reshape(-1)  # [G * masked]
        hidden.append(torch.stack([torch.full_like(cols, page - lo), (n - Ti + j).repeat(G), cols]))
    hide = torch.cat(hidden, dim=1).to(device)
    return Dense(lo, Pb, T, S, torch.cat(slots).to(device), torch.cat(rows).to(device), bias.to(device),
                 (hide[0], hide[1], hide[2]), frozenset(idx))


def attend_dense(d: Dense, k_store, v_store, q: torch.Tensor, scaling, out: torch.Tensor) -> None:
    """Scores K Q^T per (page, KV head) over the pages, in float32 as sdpa takes them (a bf16 product rounds each
    score to 8 bits: 3-5x sdpa's error against float64, enough to part tokens from AR past a near tie), the tree masks,
    float32 softmax, then P V in the model's dtype.

    # q: [Ntok, Hq, D], stores: [Pg, Hkv, P, D]; writes out[d.rows]
    """
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_store.shape[1]
    G, B, T = Hq // Hkv, d.Pb * Hkv, d.T
    scale = D**-0.5 if scaling is None else scaling
    keys = k_store[d.lo : d.lo + d.Pb, :, : d.S].reshape(B, d.S, D)  # [Pb*Hkv, S, D], a view
    values = v_store[d.lo : d.lo + d.Pb, :, : d.S].reshape(B, d.S, D)
    qp = q.new_zeros((d.Pb * T, Hq, D))
    qp[d.slots] = q[d.rows]
    qb = qp.view(d.Pb, T, Hkv, G, D).permute(0, 2, 4, 3, 1).reshape(B, D, G * T)  # columns g*T + t
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.bmm(keys.to(acc), qb.to(acc)).view(d.Pb, Hkv, d.S, G * T).mul_(scale).add_(d.bias)
    page, key, col = d.hidden
    if page.numel():
        s[page, :, key, col] = float("-inf")
    p = torch.softmax(s.transpose(2, 3), dim=3).to(q.dtype).reshape(B, G * T, d.S)
    o = torch.bmm(p, values).view(d.Pb, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(d.Pb * T, Hq, D)
    out[d.rows] = o[d.slots]
