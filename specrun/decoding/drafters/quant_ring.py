"""The quantized self-draft's forward compiled by inductor (with --compile): one graph a drafted token, over a
bf16 ring of the draft's keys and values (the first SINKS positions and the last WINDOW, as quant_torch's draft reads).

RingForward(torch_forward) keeps TorchForward's contract for one sequence (start, begin, logits); warm() compiles it.
The ring is synced from the target's cache at each begin (the committed slots it has not copied yet); the draft's own
K/V go in the ring only, never in the target's cache. Its tokens are proposals: the verify decides (I1).
"""

from __future__ import annotations

import sys
import time

import torch
import torch._dynamo

from specrun.decoding.drafters import quant_torch
from specrun.decoding.drafters.quant_torch import BF16, TorchForward, rescore
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv

RESERVE = 16  # ring slots past the window for a draft's own tokens (quant_draft.MAX_CHAIN + 1): none evicts a
# committed position the next draft's window still reads
# inductor: a value read twice (the rotated query) stored, not recomputed inside the loop over keys (inlined, the
# query's RoPE ran once per key and head); the graph's wrapper in C++ (a call's Python dispatch of ~180 kernels was ~2 ms)
OPTIONS = {"realize_reads_threshold": 1, "cpp_wrapper": True}
FIRST_SPAN = 512  # ring slots past the sinks for a new sequence, doubled (and synced anew) as its text outgrows them, up
# to WINDOW + RESERVE: a short text's draft reads a short ring (one graph for every size: the ring's length is dynamic)


class _Graph(torch.nn.Module):
    """One drafted token through the low-bit layers; attention over the ring (masked) and the token's own key."""

    def __init__(self, fwd: TorchForward):
        super().__init__()
        dec = fwd.dec
        self.nq, self.nkv, self.D, self.inter = dec.n_q, dec.n_kv, dec.head_dim, dec.inter
        self.layers = torch.nn.ModuleList(fwd.layers)  # quant_torch's modules: the same tensors, no copy
        self.norm, self.head = fwd.norm, fwd.head

    def forward(self, x, cos, sin, K, V, mask):
        """# x: [1, H] bf16, cos/sin: [1, 1, D], K/V: [Lyr, Hkv, R, D] bf16, mask: [R] float32 (0 or -inf)
        -> h: [1, H] bf16, coarse: [1, V'] float32, k, v: [Lyr, Hkv, D] bf16 (this token's)"""
        nq, nkv, D = self.nq, self.nkv, self.D
        ks, vs = [], []
        for j, L in enumerate(self.layers):
            qk, v = rotated_qkv(L, x, cos, sin, nq, nkv, D)  # [1, nq + nkv, D], [1, nkv, D]
            q = qk[0, :nq].float().view(nkv, nq // nkv, D)  # query head h = kv_head * G + g
            k, v = qk[0, nq:], v[0]  # [Hkv, D]
            s = (q[:, :, None, :] * K[j][:, None].float()).sum(-1) * L.scaling + mask  # [Hkv, G, R]
            own = (q * k.float()[:, None]).sum(-1, keepdim=True) * L.scaling  # [Hkv, G, 1]
            top = torch.maximum(s.amax(-1, keepdim=True), own)
            p, p_own = torch.exp(s - top), torch.exp(own - top)
            o = ((p[..., None] * V[j][:, None].float()).sum(-2) + p_own * v.float()[:, None]) \
                / (p.sum(-1, keepdim=True) + p_own)  # [Hkv, G, D]
            x = x + L.o(o.reshape(1, nq * D).to(BF16))
            x = mlp_residual(L, x, self.inter)
            ks.append(k)
            vs.append(v)
        h = self.norm(x)
        return h, self.head(h).float(), torch.stack(ks), torch.stack(vs)


class RingForward:
    """TorchForward's draft for one sequence through the compiled graph: attention over positions [0, SINKS) and the
    last WINDOW (this token's included), as TorchForward attends the target's cache."""

    def __init__(self, fwd: TorchForward):
        dec = fwd.dec
        self.fwd, self.dec = fwd, dec
        self.sinks, self.window = quant_torch.SINKS, quant_torch.WINDOW
        self.full = self.window + RESERVE  # ring positions past the sinks once the text fills the window
        self.graph = _Graph(fwd).eval()
        self.fn = None
        self.length = 0  # the committed length of the draft in flight
        self.calls = 0  # tokens drafted through the graph (tests check the engine takes this path)
        self.compile_seconds: float | None = None
        self.start()

    def _alloc(self, span: int) -> None:
        """An empty ring of `span` positions past the sinks (synced from slot 0 at the next begin)."""
        dec = self.dec
        self.span, R = span, self.sinks + span
        with torch.inference_mode():  # every input of the graph an inference tensor, as at its warm-up (dynamo guards)
            self.k = torch.zeros((len(dec.layers), dec.n_kv, R, dec.head_dim), dtype=BF16)  # [Lyr, Hkv, R, D]
            self.v = torch.zeros_like(self.k)
            self.pos = torch.full((R,), -1, dtype=torch.long)  # the position each slot holds, -1: none
        self.upto = 0  # committed positions copied from the target's cache

    def slot(self, p: torch.Tensor) -> torch.Tensor:
        """Ring slots of positions p (int64)."""
        return torch.where(p < self.sinks, p, self.sinks + (p - self.sinks) % self.span)

    def warm(self) -> None:
        """Compile the graph (once; progress on stderr)."""
        if self.fn is not None:
            return
        print("specrun: compiling the 4-bit self-draft (torch.compile, once per process)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        fn = torch.compile(self.graph, fullgraph=True, options=OPTIONS)
        H, D = self.dec.layers[0].o.weight.shape[0], self.dec.head_dim
        with torch.inference_mode():
            k, v, mask = torch.zeros_like(self.k), torch.zeros_like(self.v), torch.zeros(self.k.shape[2])
            for t, dim in ((k, 2), (v, 2), (mask, 0)):  # the ring's length
                torch._dynamo.mark_dynamic(t, dim)
            fn(torch.zeros((1, H), dtype=BF16), torch.ones((1, 1, D), dtype=BF16), torch.zeros((1, 1, D), dtype=BF16),
               k, v, mask)
        self.fn, self.compile_seconds = fn, time.perf_counter() - t0

    def start(self) -> None:
        """A new sequence: an empty ring of the first size."""
        self.cache = None
        self._alloc(min(FIRST_SPAN, self.full))

    @torch.inference_mode()
    def begin(self, caches: list, positions: list[int], k: int) -> None:
        """A draft of k tokens from the root at positions[0] over caches[0] (one sequence)."""
        (cache,) = caches
        if cache is not self.cache or cache.length < self.upto:  # another sequence or a replaced cache
            self.start()
            self.cache = cache
        while self.span < self.full and cache.length + k > self.sinks + self.span:  # it would wrap: a longer ring
            self._alloc(min(2 * self.span, self.full))
        self._sync(cache)
        self.length = cache.length
        self.fwd.begin(caches, positions, k)  # cos/sin of the draft's positions

    def _sync(self, cache) -> None:
        """Copy the committed positions the ring lacks (the sinks and those the window can still read)."""
        n = cache.length
        lo = max(self.upto, n - self.window)
        head, tail = (self.upto, min(self.sinks, n)), (max(lo, self.sinks), n)
        p = torch.cat([torch.arange(a, b) for a, b in (head, tail) if a < b] or [torch.zeros(0, dtype=torch.long)])
        if p.numel():
            s = self.slot(p)
            self.k[:, :, s] = cache.k[:, :, p].to(BF16)
            self.v[:, :, s] = cache.v[:, :, p].to(BF16)
            self.pos[s] = p
        self.upto = n

    def visible(self, n: int) -> torch.Tensor:
        """# -> [R] bool: the slots the token at position n attends besides itself (TorchForward's: the sinks and
        the positions of the last WINDOW before it)"""
        p = self.pos
        return (p >= 0) & (p < n) & ((p < self.sinks) | (p >= n + 1 - self.window))

    @torch.inference_mode()
    def logits(self, i: int, tokens: list[int], counts: list, thetas: list[float], belows: list[float]) -> torch.Tensor:
        """# counts[0]: [V] int32 or None -> [1, V] float32, the draft's logits after its i-th token (-inf outside the
        candidates)"""
        (token,), (count,), (theta,), (below,) = tokens, counts, thetas, belows
        n = self.length + i  # this token's position
        mask = torch.zeros(self.pos.shape).masked_fill_(~self.visible(n), float("-inf"))
        x = self.dec.embed(torch.tensor([token])).to(BF16)
        D = self.dec.head_dim  # cos/sin with the strides of the warm-up's (dynamo guards on strides)
        cos, sin = (t[0, i].reshape(1, 1, D).clone(memory_format=torch.contiguous_format) for t in (self.fwd.cos, self.fwd.sin))
        h, coarse, k, v = self.fn(x, cos, sin, self.k, self.v, mask)
        s = self.slot(torch.tensor([n]))
        self.k[:, :, s] = k[:, :, None]
        self.v[:, :, s] = v[:, :, None]
        self.pos[s] = n
        self.calls += 1
        return rescore(coarse, count, h, self.fwd.rows, theta, below)


def ring_forward(fwd: TorchForward) -> RingForward:
    """The compiled draft of a TorchForward, built and compiled once per forward (so once per decoder)."""
    if not hasattr(fwd, "_specrun_ring"):
        fwd._specrun_ring = RingForward(fwd)
    fwd._specrun_ring.warm()
    return fwd._specrun_ring
