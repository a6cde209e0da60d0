"""The quantized self-draft's graph that inductor compiles (quant_ring.py runs it, ring_package.py builds and caches it):
one drafted token a sequence through the low-bit layers, attention over its ring, the head's best CANDIDATES rescored.

Graph(torch_forward) traces that forward's layers in its bits; options(bits) are inductor's settings for them.
"""

from __future__ import annotations

import torch

from specrun.decoding.drafters.quant_torch import BF16, TorchForward
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv

# inductor: a value read twice (the rotated query) stored, not recomputed inside the loop over keys (inlined, the
# query's RoPE ran once per key and head)
OPTIONS = {"realize_reads_threshold": 1}
# 8-bit layers (quant_torch.compiled_bits): inductor's C++ GEMM template for int8 weights, the weights frozen into it
INT8 = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
BLOCK = 16  # ring slots a block of the keys' layout: a vector of scores (quant_ring keeps its rings' sizes multiples)
CANDIDATES = 64  # a drafted token's candidates: the best of the penalised 4-bit logits, rescored by the model's own
# head rows in the graph (the eager draft keeps every token within its margin: ~40 a row on smollm2, sampled)


class Graph(torch.nn.Module):
    """One drafted token a sequence through the low-bit layers; attention over each one's ring (masked) and the
    token's own key."""

    def __init__(self, fwd: TorchForward):
        super().__init__()
        dec = fwd.dec
        self.nq, self.nkv, self.D, self.inter = dec.n_q, dec.n_kv, dec.head_dim, dec.inter
        self.layers = torch.nn.ModuleList(fwd.layers)  # quant_torch's modules: the same tensors, no copy
        self.norm, self.head = fwd.norm, fwd.head
        self.candidates = min(CANDIDATES, fwd.rows.shape[0])
        self.bits, self.options = fwd.bits, options(fwd.bits)

    def forward(self, x, cos, sin, K, V, mask, counts, theta, below, rows):
        """# x: [B, H] bf16, cos/sin: [B, 1, D], K: [B, Lyr, Hkv, R / BLOCK, D, BLOCK] bf16 (keys in blocks of slots,
        each block's slots innermost), V: [B, Lyr, Hkv, D, R] bf16 (values transposed), mask: [B, R] float32 (0 or
        -inf), counts: [B, V] int32, theta/below: [B, 1] float32, rows: [V, H] (the model's head, in its dtype)
        -> logits: [B, C] float32 (-inf: not a candidate), ids: [B, C] long ascending, k, v: [B, Lyr, Hkv, D] bf16
        (these tokens')"""
        nq, nkv, D = self.nq, self.nkv, self.D
        B, R = x.shape[0], V.shape[-1]
        ks, vs = [], []
        for j, L in enumerate(self.layers):
            qk, v = rotated_qkv(L, x, cos, sin, nq, nkv, D)  # [B, nq + nkv, D], [B, nkv, D]
            q = qk[:, :nq].float().view(B, nkv, nq // nkv, D)  # query head h = kv_head * G + g
            k = qk[:, nq:]  # [B, Hkv, D]
            # both products run along the slots, the reduction outside the vector: no horizontal sum a score
            s = (q[:, :, :, None, :, None] * K[:, j, :, None].float()).sum(-2)  # [B, Hkv, G, R / BLOCK, BLOCK]
            s = s.reshape(B, nkv, nq // nkv, R) * L.scaling + mask[:, None, None]  # [B, Hkv, G, R]
            own = (q * k.float()[:, :, None]).sum(-1, keepdim=True) * L.scaling  # [B, Hkv, G, 1]
            top = torch.maximum(s.amax(-1, keepdim=True), own)
            p, p_own = torch.exp(s - top), torch.exp(own - top)
            o = ((p[:, :, :, None, :] * V[:, j, :, None].float()).sum(-1) + p_own * v.float()[:, :, None]) \
                / (p.sum(-1, keepdim=True) + p_own)  # [B, Hkv, G, D]
            x = x + L.o(o.reshape(B, nq * D).to(BF16))
            x = mlp_residual(L, x, self.inter)
            ks.append(k)
            vs.append(v)
        h = self.norm(x)
        logits, ids = self.rescore(h, self.head(h).float(), counts, theta, below, rows)
        return logits, ids, torch.stack(ks, 1), torch.stack(vs, 1)

    def rescore(self, h, coarse, counts, theta, below, rows):
        """quant_torch.rescore's rule on each row's best `candidates`: those whose penalised coarse logit is within
        `below` of the row's best get h . rows[v], by token id. # h: [B, H], coarse/counts: [B, V], theta/below: [B, 1],
        rows: [V, H] -> logits [B, C] float32 (-inf: not kept), ids [B, C] long ascending"""
        c = torch.where(counts > 0, torch.where(coarse > 0, coarse / theta, coarse * theta), coarse)
        best, ids = c.topk(self.candidates, dim=-1)  # [B, C] descending
        keep = best >= best[:, :1] - below
        ids, order = ids.sort(dim=-1)  # the token order: ties pick as over the whole vocabulary
        exact = (rows[ids].float() * h.float()[:, None]).sum(-1).to(rows.dtype).float()  # [B, C], as the eager head
        return exact.masked_fill(~keep.gather(1, order), float("-inf")), ids


def options(bits: int) -> dict:
    """inductor's settings for a graph whose layers are in `bits`."""
    return OPTIONS if bits == 4 else {**OPTIONS, **INT8}
