"""Attention backends behind one switch, registered as a transformers attention function ("specrun").

Each call writes the layer's new K/V into our cache and attends over [committed + new] with an explicit bool mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specrun.decoding.kv_cache import KVCache

ATTN_IMPL = "specrun"
BACKENDS = ("sdpa",)


@dataclass
class ForwardContext:
    """What one model forward needs beyond the transformers call: where to write, what to see."""

    cache: KVCache
    start: int  # first slot of this forward's tokens (= cache.length)
    mask: torch.Tensor | None  # [T, start+T] bool, True = attend; None with `select`
    select: torch.Tensor | None = None  # [Lyr, Hkv, B] slots each KV head sees (partial cache), then its own token
    queries: list | None = None  # when a list, each layer appends its q [Hq, T, D] (for KV importance)


def sdpa_attention(ctx: ForwardContext, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling):
    """Reference backend on torch SDPA; GQA by folding query groups into the query axis (no K/V copies).

    # q: [1, Hq, T, D], k/v: [1, Hkv, T, D] (post-RoPE) -> [1, T, Hq, D]
    """
    _, Hq, T, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if ctx.queries is not None:
        ctx.queries.append(q[0])
    ctx.cache.write(layer, ctx.start, k[0].transpose(0, 1), v[0].transpose(0, 1))
    qg = q.reshape(1, Hkv, G * T, D)  # query head h = kv_head * G + g
    if ctx.select is not None:  # one token against its partial cache: gather the selected slots per KV head
        keys, values = ctx.cache.gather(layer, ctx.select[layer], ctx.start, T)  # [Hkv, B+T, D]
        mask = None
    else:
        keys, values = ctx.cache.keys_values(layer, ctx.start + T)  # [Hkv, S, D]
        mask = (ctx.mask.repeat(G, 1) if G > 1 else ctx.mask)[None, None]  # [1, 1, G*T, S]
    # 4-D operands: torch's CPU SDPA takes a far slower path for 3-D inputs with a mask
    out = F.scaled_dot_product_attention(qg, keys[None], values[None], attn_mask=mask, scale=scaling)
    return out.reshape(Hq, T, D).transpose(0, 1).unsqueeze(0)  # [1, T, Hq, D]


def _specrun_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx: ForwardContext | None = kwargs.pop("specrun_ctx", None)
    if ctx is None:  # a plain transformers call (e.g. HF generate on the same model object)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return sdpa_attention(ctx, module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPL, _specrun_attention)
