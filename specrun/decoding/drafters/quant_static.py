"""The 4-bit draft's depth with static shapes, one sequence: its token, position and cache slot in device tensors, its
attention over a fixed gather of the cache (the sinks and the last window), so that on CUDA it is a CUDA graph.

StaticDraft(forward).coarse(cache, token, position, slot) -> (h [1, H], coarse [1, V]): what TorchForward.logits
computes before rescoring (the drafted token's K/V written at `slot`). On CUDA it is captured once per cache and
replayed (an eager draft token of an 8B model is ~600 kernel launches); elsewhere the same function runs eagerly: the
twin the tests compare with the eager forward.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specrun.decoding.drafters import quant_torch
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv
from specrun.decoding.forward.static_step import capture_graph


def window_slots(n: torch.Tensor, keys: int, sinks: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache slots a draft row at n visible slots attends, as `keys` gathered slots and which of them are live:
    all of [0, n) while n <= keys (the rest padding), else the first `sinks` and the last `window` (keys = their sum
    where the cache can hold that many; TorchForward._attend's set).

    # n: [1] long (on the device) -> slots: [keys] long, live: [keys] bool
    """
    j = torch.arange(keys, device=n.device)
    whole = n <= keys
    slots = torch.where(whole | (j < sinks), j, n - window + (j - sinks))
    live = ~whole | (j < n)
    return torch.where(live, slots, 0), live


class StaticDraft:
    """A TorchForward's one-row depth over static inputs: a CUDA graph per cache on CUDA (captured at its first draft
    and replayed; if the capture fails, a warning and the eager function from then on), the eager function elsewhere."""

    def __init__(self, forward, graphs: bool | None = None):
        self.fwd = forward
        dev = forward.device
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self._key = None  # the cache the graph reads (its tensors' addresses and shape)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.replays = 0  # depths served by a graph (the GPU check reports it)

    def _body(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """# k/v: the cache [Lyr, Hkv, S, D] -> h: [1, H] bf16, coarse: [1, V] float32"""
        fwd, dec = self.fwd, self.fwd.dec
        nq, nkv, D, S = dec.n_q, dec.n_kv, dec.head_dim, k.shape[2]
        sinks, window = quant_torch.SINKS, quant_torch.WINDOW
        slots, live = window_slots(self.slot + 1, min(sinks + window, S), sinks, window)  # [K] each
        mask = live[None, None, None, :]  # [1, 1, 1, K]
        x, cos, sin = dec.embed_rope(self.token, self.position)  # [1, H], [1, 1, D] each
        x, cos, sin = x.to(quant_torch.BF16), cos.to(quant_torch.BF16), sin.to(quant_torch.BF16)
        for j, L in enumerate(fwd.layers):
            qk, val = rotated_qkv(L, x, cos, sin, nq, nkv, D)  # [1, nq + nkv, D], [1, nkv, D]
            k[j].index_copy_(1, self.slot, qk[:, nq:].transpose(0, 1).to(k.dtype))  # [Hkv, 1, D] at the slot
            v[j].index_copy_(1, self.slot, val.transpose(0, 1).to(v.dtype))
            kw, vw = k[j].index_select(1, slots), v[j].index_select(1, slots)  # [Hkv, K, D]
            q = qk[0, :nq].reshape(nkv, nq // nkv, D).to(k.dtype)  # query head h = kv_head * G + g
            o = F.scaled_dot_product_attention(q[None], kw[None], vw[None], attn_mask=mask, scale=L.scaling)
            x = x + L.o(o.reshape(1, nq * D).to(quant_torch.BF16))
            x = mlp_residual(L, x, dec.inter)
        h = fwd.norm(x)
        return h, fwd.head(h).float()

    @torch.inference_mode()
    def coarse(self, cache, token: int, position: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafted row after `token` at `position`, its K/V written at cache slot `slot` (cache: anything with k,
        v [Lyr, Hkv, S, D]); -> (h [1, H], coarse [1, V]), valid until the next call."""
        self.token.fill_(token)
        self.position.fill_(position)
        self.slot.fill_(slot)
        if not self.graphs:
            return self._body(cache.k, cache.v)
        key = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape))
        if key != self._key:
            self._key, self._graph = key, None
            try:
                self._graph, self._out = capture_graph(lambda: self._body(cache.k, cache.v))
            except RuntimeError as e:  # a capture the device refuses: the draft stays eager (speed only)
                warnings.warn(f"the 4-bit draft's CUDA graph failed ({str(e)[:200]}); it runs eagerly",
                              RuntimeWarning, stacklevel=2)
                self.graphs = False
                return self._body(cache.k, cache.v)
        self._graph.replay()
        self.replays += 1
        return self._out
