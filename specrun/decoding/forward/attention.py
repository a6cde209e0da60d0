"""Attention backends behind one switch (ForwardContext.backend), called by the decoder forward (decoder.py).

Each call writes the layer's new K/V into our cache and attends over [committed + new]: `sdpa` with one bool mask over
all keys (the reference; in bf16 and float32 on CPUs with AVX-512 BF16 our kernel cpu_kernels.c computes the same
attention, each row alone: AR steps, verifies and prefill give a token the same K/V; bf16 1.5-1.9x faster than SDPA up
to 16 rows, float32 1.4x at one row and 1.8x at 8, 1,000 keys); `split`
attends the committed prefix without a mask and the new tokens under their own mask, then merges the two by
log-sum-exp (the scheme a flashinfer backend uses to avoid masked kernels over long caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specrun.decoding.choices import BACKENDS
from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.kernels.cpu_kernels import CpuKernels


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")


@dataclass
class ForwardContext:
    """What one model forward needs beyond the transformers call: where to write, what to see."""

    cache: KVCache
    start: int  # first slot of this forward's tokens (= cache.length)
    mask: torch.Tensor | None  # [T, start+T] bool, True = attend; None with `select`
    select: torch.Tensor | None = None  # [Lyr, Hkv, B] slots each KV head sees (partial cache), then its own token
    queries: list | None = None  # when a list, each layer appends its q [Hq, T, D] (for KV importance)
    backend: str = "sdpa"  # one of BACKENDS; the prefix [0, start) is always fully visible to the new tokens
    kernels: CpuKernels | None = None  # with `sdpa`: attend with cpu_kernels' attend (bf16, float32)
    _grouped: torch.Tensor | None = None

    @property
    def whole_layers(self) -> bool:
        """Whether cpu_layers may run this forward's layers in one call: our attention over every slot (queries are
        kept there too, so a verify that keeps them computes what an AR step does)."""
        return self.kernels is not None and self.select is None

    def attend(self, layer: int, q, k, v, scaling):
        return attention(self, layer, q, k, v, scaling)

    def group_mask(self, G: int) -> torch.Tensor:
        """The mask repeated for G query heads per KV head, built once per forward. # -> [G*T, start+T] bool"""
        if self._grouped is None:
            self._grouped = self.mask.repeat(G, 1) if G > 1 else self.mask
        return self._grouped


def attention(ctx: ForwardContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
    """Write the new K/V, attend with ctx.backend; GQA by folding query groups into the query axis (no K/V copies).

    # q: [1, Hq, T, D], k/v: [1, Hkv, T, D] (post-RoPE) -> [1, T, Hq, D]
    """
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if ctx.queries is not None:
        ctx.queries.append(q[0])
    ctx.cache.write(layer, ctx.start, k[0], v[0])
    qg = q.reshape(1, Hkv, G * T, D)  # query head h = kv_head * G + g
    if ctx.select is not None:  # one token against its partial cache: gather the selected slots per KV head
        keys, values = ctx.cache.gather(layer, ctx.select[layer], ctx.start, T)  # [Hkv, B+T, D]
        out = F.scaled_dot_product_attention(qg, keys[None], values[None], scale=scaling)
    elif ctx.backend == "split":
        out = _split_attention(ctx, layer, qg, G, scaling)
    elif ctx.kernels is not None:
        new = None if T == 1 else ctx.mask[:, ctx.start : ctx.start + T]  # [T, T] the rows' view of the new tokens
        out = ctx.kernels.attend(q[0].transpose(0, 1), ctx.cache.k[layer], ctx.cache.v[layer], ctx.start, new,
                                 D**-0.5 if scaling is None else scaling)  # [T, Hq, D]
        return out[None]
    else:
        keys, values = ctx.cache.keys_values(layer, ctx.start + T)  # [Hkv, S, D]
        # 4-D operands: torch's CPU SDPA takes a far slower path for 3-D inputs with a mask; one new token sees every
        # slot, so it needs no mask at all
        mask = None if T == 1 else ctx.group_mask(G)[None, None]  # [1, 1, G*T, S]
        out = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=mask, scale=scaling)
    return out.reshape(Hq, T, D).transpose(0, 1).unsqueeze(0)  # [1, T, Hq, D]


def _split_attention(ctx: ForwardContext, layer: int, qg: torch.Tensor, G: int, scaling) -> torch.Tensor:
    """Prefix without a mask + new tokens under their [T, T] mask, merged by log-sum-exp.

    # qg: [1, Hkv, G*T, D] -> [1, Hkv, G*T, D]
    """
    T = qg.shape[2] // G
    start = ctx.start
    keys, values = ctx.cache.keys_values(layer, start + T)  # [Hkv, S, D]
    if T == 1:  # a single new token sees every slot: one unmasked call, nothing to merge
        return F.scaled_dot_product_attention(qg, keys[None], values[None], scale=scaling)
    block = ctx.group_mask(G)[:, start : start + T]  # [G*T, T]
    o_new, lse_new = attend_lse(qg[0], keys[:, start:], values[:, start:], scaling, block)
    if start == 0:
        return o_new[None].to(qg.dtype)
    o_pre, lse_pre = attend_lse(qg[0], keys[:, :start], values[:, :start], scaling)
    return merge_states(o_pre, lse_pre, o_new, lse_new)[0][None].to(qg.dtype)


def attend_lse(q, k, v, scale, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp, in float32 at least (every query row must see one key or more).

    # q: [Hkv, N, D], k/v: [Hkv, S, D], mask: [N, S] bool or None -> o: [Hkv, N, D], lse: [Hkv, N]
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if mask is None and q.device.type == "cpu" and q.dtype == k.dtype:
        # torch's CPU flash kernel returns the log-sum-exp: no [N, S] score matrix for long prefixes
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q[None], k[None], v[None], scale=scale)[:2]
        return o[0].to(acc), lse[0].to(acc)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [Hkv, N, S]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse[..., None]), v.to(acc)), lse


def merge_states(o1, lse1, o2, lse2) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets -> attention over their union (flashinfer's merge_state).

    # o1, o2: [..., N, D], lse1, lse2: [..., N] -> o: [..., N, D], lse: [..., N]
    """
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None], lse
