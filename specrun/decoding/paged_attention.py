"""Attention for a forward over packed sequences in the paged pool, behind one switch: sdpa | paged | flashinfer.

`sdpa` (the reference) attends each sequence as a solo run does (same kernel, same operand shapes: bit-identical on
CPU); `paged` interprets the plan arrays flashinfer takes, in torch; `flashinfer` hands the same plan to flashinfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specrun.decoding.paged_kv import PagePool
from specrun.decoding.plan import BatchPlan

PAGED_BACKENDS = ("sdpa", "paged", "flashinfer")


def check_paged_backend(name: str) -> None:
    if name not in PAGED_BACKENDS:
        raise ValueError(f"unknown batched attention backend {name!r}; choose from {', '.join(PAGED_BACKENDS)}")


def _gather(store: torch.Tensor, pages: torch.Tensor, n: int) -> torch.Tensor:
    """A sequence's first n tokens of one layer, contiguous per head. # store: [Pg, Hkv, P, D] -> [Hkv, n, D]"""
    if pages.shape[0] == 1:  # one page per sequence (P >= its need, as on CPU): a view, nothing copied
        return store[int(pages[0]), :, :n]
    x = store[pages.long()]  # [pages, Hkv, P, D]
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[3])[:, :n]


def sdpa_masks(plan: BatchPlan, G: int, device) -> list[torch.Tensor | None]:
    """Per sequence the solo path's mask (prefix visible, tree mask on the new tokens, repeated for G query heads per
    KV head), built once per forward; None for one new token (it sees every key). # -> [1, 1, G*T_i, S_i] bool"""
    masks = []
    for i in range(plan.batch_size):
        T, S = plan.qo_len(i), plan.kv_len(i)
        if T == 1:
            masks.append(None)
            continue
        mask = torch.ones((T, S), dtype=torch.bool, device=device)
        mask[:, S - T :] = plan.tree_masks[i].to(device)
        masks.append((mask.repeat(G, 1) if G > 1 else mask)[None, None])
    return masks


def attend_sdpa(plan: BatchPlan, k_store, v_store, q: torch.Tensor, scaling, masks) -> torch.Tensor:
    """Per sequence, exactly the solo path (decoding/attention.py): GQA folded into the query axis, the prefix visible.

    # q: [Ntok, Hq, D], masks: sdpa_masks(plan, Hq // Hkv) -> [Ntok, Hq, D]
    """
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_store.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        T, S = b - a, plan.kv_len(i)
        keys, values = _gather(k_store, plan.pages(i), S), _gather(v_store, plan.pages(i), S)
        qg = q[a:b].transpose(0, 1).reshape(1, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=masks[i], scale=scaling)
        out[a:b] = o.reshape(Hq, T, D).transpose(0, 1)
    return out


def attend_paged(plan: BatchPlan, k_store, v_store, q: torch.Tensor, scaling) -> torch.Tensor:
    """The plan read as flashinfer reads it: pages via kv_indptr/kv_indices/last_page_len, the packed custom mask.

    # q: [Ntok, Hq, D] -> [Ntok, Hq, D]
    """
    Hq, D = q.shape[1], q.shape[2]
    G = Hq // k_store.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = D**-0.5 if scaling is None else scaling
    out = torch.empty_like(q)
    for i in range(plan.batch_size):
        a, b = int(plan.qo_indptr[i]), int(plan.qo_indptr[i + 1])
        S = plan.kv_len(i)
        keys = _gather(k_store, plan.pages(i), S).repeat_interleave(G, dim=0).to(acc)  # [Hq, S, D]
        values = _gather(v_store, plan.pages(i), S).repeat_interleave(G, dim=0).to(acc)
        s = torch.matmul(q[a:b].transpose(0, 1).to(acc), keys.transpose(1, 2)) * scale  # [Hq, T, S]
        mask = plan.mask(i)
        if mask is not None:
            s = s.masked_fill(~mask.to(q.device), float("-inf"))
        out[a:b] = torch.matmul(s.softmax(dim=-1), values).transpose(0, 1).to(q.dtype)
    return out


@dataclass
class FlashInferAttention:
    """flashinfer's BatchPrefillWithPagedKVCacheWrapper over the pool (HND layout): planned once per forward."""

    device: torch.device
    workspace_mb: int = 128
    _wrapper: object = field(default=None, repr=False)

    def plan(self, plan: BatchPlan, n_q: int, n_kv: int, head_dim: int, dtype, scaling) -> None:
        if self._wrapper is None:
            try:
                import flashinfer
            except ImportError as e:
                raise RuntimeError("the flashinfer attention backend needs flashinfer: pip install 'specrun[cuda]'") from e
            workspace = torch.zeros(self.workspace_mb << 20, dtype=torch.uint8, device=self.device)
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        dev = self.device
        self._wrapper.plan(
            plan.qo_indptr.to(dev), plan.kv_indptr.to(dev), plan.kv_indices.to(dev), plan.kv_last_page_len.to(dev),
            n_q, n_kv, head_dim, plan.page_size,
            packed_custom_mask=None if plan.mask_packed is None else plan.mask_packed.to(dev),
            causal=False, sm_scale=scaling, q_data_type=dtype, kv_data_type=dtype,
        )

    def run(self, k_store, v_store, q: torch.Tensor) -> torch.Tensor:
        """# q: [Ntok, Hq, D], stores: [Pg, Hkv, P, D] -> [Ntok, Hq, D]"""
        return self._wrapper.run(q, (k_store, v_store))


@dataclass
class BatchContext:
    """What one packed forward needs beyond the weights: the pool, the plan, the backend (decoder calls attend)."""

    pool: PagePool
    plan: BatchPlan
    backend: str = "sdpa"
    flashinfer: FlashInferAttention | None = None
    _masks: list | None = None  # sdpa: per-sequence masks, built at the first layer and kept for the others

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
        """Write the new tokens' K/V into their pages, then attend. # q: [1, Hq, N, D], k/v: [1, Hkv, N, D] -> [1, N, Hq, D]"""
        k_store, v_store = self.pool.k[layer], self.pool.v[layer]  # [Pg, Hkv, P, D]
        pages, offsets = self.plan.write_pages, self.plan.write_offsets
        k_store[pages, :, offsets] = k[0].transpose(0, 1)  # [N, Hkv, D]
        v_store[pages, :, offsets] = v[0].transpose(0, 1)
        qn = q[0].transpose(0, 1)  # [N, Hq, D]
        if self.backend == "flashinfer":
            out = self.flashinfer.run(k_store, v_store, qn.contiguous())
        elif self.backend == "paged":
            out = attend_paged(self.plan, k_store, v_store, qn, scaling)
        else:
            if self._masks is None:
                self._masks = sdpa_masks(self.plan, q.shape[1] // k.shape[1], q.device)
            out = attend_sdpa(self.plan, k_store, v_store, qn, scaling, self._masks)
        return out[None]
