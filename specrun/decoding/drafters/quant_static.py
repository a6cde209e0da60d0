"""The 4-bit draft's depth with static shapes, one sequence: its token, position and cache slot in device tensors, its
attention over a fixed gather of the cache (the sinks and the last window), so that on CUDA it is a CUDA graph.

StaticDraft(forward).coarse(cache, token, position, slot) -> (h [1, H], coarse [1, V]): what TorchForward.logits
computes before rescoring (the drafted token's K/V written at `slot`). On CUDA it is captured once per cache and
replayed (an eager draft token of an 8B model is ~600 kernel launches); elsewhere the same function runs eagerly: the
twin the tests compare with the eager forward (on CUDA the attention takes the memory-efficient kernel instead).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specrun.decoding.drafters import quant_torch
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv
from specrun.decoding.forward.static_step import capture_graph


def window_slots(n: torch.Tensor, keys: int, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots a draft row at n visible slots attends (TorchForward._attend's set), as `keys` gathered slots
    (at least sinks + window, or the cache's slots if fewer) and which of them are live: all of [0, n) while
    n <= sinks + window, else the first `sinks` and the last `window`; the rest padding.

    # n: [1] long (on the device) -> slots: [keys] long, live: [keys] bool
    """
    j = torch.arange(keys, device=n.device)
    whole = n <= sinks + window
    slots = torch.where(whole | (j < sinks), j, n - window + (j - sinks))
    live = torch.where(whole, j < n, j < sinks + window)
    return torch.where(live, slots, 0), live


MAX_GRAPHS = 4  # caches with a graph kept at once (engines sharing a decoder's draft alternate without recapturing)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, live: torch.Tensor, scale: float) -> torch.Tensor:
    """q over the live keys: on CUDA the memory-efficient kernel with an additive bias, as static_step's verify runs
    it (SDPA could pick another backend for a mask broadcast over the heads), else SDPA with the mask.

    # q: [Hkv, G, D], k/v: [Hkv, K, D] (K a multiple of 16), live: [K] bool -> [Hkv, G, D]
    """
    if q.device.type == "cuda" and q.dtype != torch.float64:
        bias = torch.where(live, 0.0, float("-inf")).to(q.dtype).expand(1, q.shape[0], q.shape[1], k.shape[1])
        return torch.ops.aten._scaled_dot_product_efficient_attention(q[None], k[None], v[None], bias, False,
                                                                        scale=scale)[0][0]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=live[None], scale=scale)[0]


class StaticDraft:
    """A TorchForward's one-row depth over static inputs: on CUDA a CUDA graph per cache (captured at its first draft,
    replayed after), the eager function elsewhere. Where a capture fails: a warning, and coarse() answers None from
    then on (TorchForward then drafts with its own eager forward)."""

    def __init__(self, forward, graphs: bool | None = None):
        self.fwd = forward
        dev = forward.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self.failed = False
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self._graphs: dict[tuple, tuple] = {}  # (the cache's k and v addresses, shape) -> (graph, its outputs)
        self.replays = 0  # depths served by a graph (the GPU check reports it)

    def _body(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """# k/v: the cache [Lyr, Hkv, S, D] -> h: [1, H] bf16, coarse: [1, V] float32"""
        fwd, dec = self.fwd, self.fwd.dec
        nq, nkv, D, S = dec.n_q, dec.n_kv, dec.head_dim, k.shape[2]
        sinks, window = quant_torch.SINKS, quant_torch.WINDOW
        keys = -(-min(sinks + window, S) // 16) * 16  # whole tiles of 16 keys for the CUDA kernel
        slots, live = window_slots(self.slot + 1, keys, sinks, window)  # [K] each
        x, cos, sin = dec.embed_rope(self.token, self.position)  # [1, H], [1, 1, D] each
        x, cos, sin = x.to(quant_torch.BF16), cos.to(quant_torch.BF16), sin.to(quant_torch.BF16)
        for j, L in enumerate(fwd.layers):
            qk, val = rotated_qkv(L, x, cos, sin, nq, nkv, D)  # [1, nq + nkv, D], [1, nkv, D]
            k[j].index_copy_(1, self.slot, qk[:, nq:].transpose(0, 1).to(k.dtype))  # [Hkv, 1, D] at the slot
            v[j].index_copy_(1, self.slot, val.transpose(0, 1).to(v.dtype))
            kw, vw = k[j].index_select(1, slots), v[j].index_select(1, slots)  # [Hkv, K, D]
            q = qk[0, :nq].reshape(nkv, nq // nkv, D).to(k.dtype)  # query head h = kv_head * G + g
            o = _attend(q, kw, vw, live, L.scaling)  # [Hkv, G, D]
            x = x + L.o(o.reshape(1, nq * D).to(quant_torch.BF16))
            x = mlp_residual(L, x, dec.inter)
        h = fwd.norm(x)
        return h, fwd.head(h).float()

    @torch.inference_mode()
    def coarse(self, cache, token: int, position: int, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One drafted row after `token` at `position`, its K/V written at cache slot `slot` (cache: anything with k,
        v [Lyr, Hkv, S, D]); -> (h [1, H], coarse [1, V]), valid until the next call; None once a capture failed."""
        if self.failed:
            return None
        self.token.fill_(token)
        self.position.fill_(position)
        self.slot.fill_(slot)
        if not self.graphs:
            return self._body(cache.k, cache.v)
        key = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape))
        if key not in self._graphs:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))  # the oldest
            try:
                self._graphs[key] = capture_graph(lambda: self._body(cache.k, cache.v))
            except RuntimeError as e:  # the device refused the function or its capture: drafting changes speed only
                warnings.warn(f"the 4-bit draft's CUDA graph failed ({str(e)[:200]}); it drafts eagerly",
                              RuntimeWarning, stacklevel=2)
                self.failed, self._graphs = True, {}
                return None
        graph, out = self._graphs[key]
        graph.replay()
        self.replays += 1
        return out
