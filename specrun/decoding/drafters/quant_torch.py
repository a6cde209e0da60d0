"""The quantized self-draft's forward on torch's own low-bit kernels, for devices our C kernels do not take: the
target's linear weights in 4 bits (quant.py's grid: the CPU's int4 kernel, or tinygemm on CUDA) or 8 (CPU), bf16
activations, attention over the target's KV cache (sinks and a window).

TorchForward.of(decoder) is None where torch's kernels do not take the model; else begin(caches, positions, k) once a
draft, then logits(i, tokens, counts, thetas, belows) per depth, a row per sequence (quant_draft.KernelForward: one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrun.decoding.forward.attention import attend_lse, merge_states
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv
from specrun.decoding.forward.quant import GROUP, grid, quantizable

# the draft attends the first SINKS slots and the last WINDOW (its own drafted tokens among them), so its cost per
# token stays flat as the text grows while the verify reads the whole cache (TokenSwift's partial KV); ~4K slots as the
# self-draft heads' default kv_budget (a 1,024-slot window halved its acceptance past 1K tokens: docs/benchmarks.md). 64
# sinks, not 4: a chat prompt's opening (its system turn) keeps the draft on the model's track once the window slides.
# SINKS + WINDOW + the compiled draft's reserve for a chain (quant_ring.RESERVE, 16) = 4,096 ring slots, the most its
# package takes (past 4,096 keys inductor's C++ reductions accumulate another way)
SINKS = 64
WINDOW = 4016
BF16 = torch.bfloat16


def int4_kernel(device: torch.device) -> bool:
    """Whether torch has an int4 product with bf16 rows here: the CPU's, or tinygemm on a CUDA GPU of compute
    capability 8.0 or later (its tensor-core layout)."""
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    return device.type == "cuda" and hasattr(torch.ops.aten, "_weight_int4pack_mm") \
        and torch.cuda.get_device_capability(device) >= (8, 0)


def int4_operands(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W on quant.py's grid as both of torch's int4 kernels take it, rows padded to 16: codes two a byte (element 2i in
    the high nibble, 2i + 1 in the low: tinygemm's packer input) and each group's scale and zero, for
    w = (q - 8) * scale + zero (both kernels' rule: zero = minimum + 8 scale).

    # weight: [N, K] -> codes: [N', K / 2] uint8, scales: [K / GROUP, N', 2] bf16 (N' = N rounded up to 16)
    """
    n = weight.shape[0]
    padded = weight.new_zeros((-(-n // 16) * 16, weight.shape[1]))  # the CPU kernel packs rows 16 at a time
    padded[:n] = weight.detach()
    q, d, low = grid(padded)  # [N', K] codes, [N', G] float16 scale and minimum
    d32 = d.float()
    scales = torch.stack((d32, low.float() + 8 * d32), dim=-1).transpose(0, 1).to(BF16).contiguous()
    return ((q[:, 0::2] << 4) | q[:, 1::2]).contiguous(), scales


def int4_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4_operands' bytes back to one code an element. # [N, K / 2] uint8 -> [N, K] uint8"""
    return torch.stack((codes >> 4, codes & 15), dim=-1).flatten(1)


class Int4Linear(torch.nn.Module):
    """y = x W^T (+ b) with W on quant.py's grid, packed for torch's int4 kernel of its device (bf16 activations): the
    CPU's, or tinygemm on CUDA (its k-tiles packed 8, 4 or 2 deep, whichever divides the inputs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.n = weight.shape[0]
        codes, scales = int4_operands(weight)
        if weight.device.type == "cuda":
            tiles = next(t for t in (8, 4, 2) if weight.shape[1] % (16 * t) == 0)  # GROUP = 32 divides the inputs
            packed = torch.ops.aten._convert_weight_to_int4pack(codes, tiles)  # [N' / 8, K / 16t, 32, t / 2] int32
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4_codes(codes).to(torch.int32), 1)
        self.register_buffer("packed", packed)
        self.register_buffer("scales", scales)  # [G, N', 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """# x: [T, K] bf16 -> [T, N] bf16"""
        if self.packed.dim() == 4:  # tinygemm's layout
            y = torch.ops.aten._weight_int4pack_mm(x.contiguous(), self.packed, GROUP, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        y = y if y.shape[-1] == self.n else y[:, : self.n]
        return y if self.bias is None else y + self.bias


class Int8Linear(torch.nn.Module):
    """y = x W^T (+ b) with W in 8 bits, one symmetric scale a row, for torch's CPU int8 kernel (bf16 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127  # [N]
        self.register_buffer("q", (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("scales", scale.to(BF16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(BF16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """# x: [T, K] bf16 -> [T, N] bf16"""
        y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        return y if self.bias is None else y + self.bias


def compiled_bits(fwd) -> int:
    """The bits of the compiled draft's layers (quant_ring.py): 8 on an AVX2 CPU, where torch's int4 product is
    compute-bound and inductor's int8 GEMM template (AVX2) runs faster (docs/benchmarks.md, stop 67); else fwd's own."""
    return 8 if fwd.device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX2" else fwd.bits


def on_grid(weights: list[torch.Tensor]) -> bool:
    """Whether these weights already sit on a 4-bit grid of groups of 32 (a GGUF Q4 model's): their round trip through
    quant.grid moves them by under 5% of a step on average (a model trained in bf16: ~25%)."""
    moved = steps = 0.0
    for w in weights:
        q, d, low = grid(w)
        deq = q.float().view(*d.shape, GROUP) * d.float()[..., None] + low.float()[..., None]
        moved += float((deq.view_as(w) - w.float()).abs().sum())
        steps += float(d.float().sum()) * GROUP
    return moved <= 0.05 * steps


class _Norm(torch.nn.Module):
    """RMSNorm in bf16 (torch's fused op: a draft's values need only be close to the model's)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.register_buffer("weight", module.weight.detach().to(BF16))
        self.eps = float(module.variance_epsilon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class _Layer(torch.nn.Module):
    """A draft layer as rotated_qkv reads it (ln1, qkv, q_norm, k_norm); its parts are modules, so a compiled graph
    (quant_ring's) takes their tensors as inputs."""

    def __init__(self, L, Lin: type[Int4Linear | Int8Linear]):
        super().__init__()
        self.ln1, self.ln2 = _Norm(L.ln1), _Norm(L.ln2)
        self.qkv, self.o = Lin(L.qkv.weight, L.qkv.bias), Lin(L.o.weight)
        self.gate_up, self.down = Lin(L.gate_up.weight), Lin(L.down.weight)
        self.act, self.scaling = L.act, float(L.scaling)
        self.q_norm = None if L.q_norm is None else _Norm(L.q_norm)
        self.k_norm = None if L.k_norm is None else _Norm(L.k_norm)


def rescore(coarse: torch.Tensor, counts: list, h: torch.Tensor, rows: torch.Tensor, thetas: list[float],
            belows: list[float]) -> torch.Tensor:
    """Each row's logits by the model's own head rows for the tokens whose penalised coarse logit (thetas[b] on the
    tokens counts[b] counts) is at least its best one less belows[b], -inf for the rest (cpu_kernels.c rescore_bf16's
    rule). One product for every row's candidates at once (a batched draft's rows cost small ops per depth, not per row).

    # coarse: [B, V] float32, counts[b]: [V] int32 or None, h: [B, H], rows: [V, H] -> [B, V] float32
    """
    c = coarse
    for b, (n, theta) in enumerate(zip(counts, thetas)):
        if n is not None and theta != 1.0:  # the tokens counted alone: a window's few hundred, not the vocabulary
            c = coarse.clone() if c is coarse else c
            at = n.nonzero()[:, 0]
            v = c[b, at]
            c[b, at] = torch.where(v > 0, v / theta, v * theta)
    keep = c >= c.amax(1, keepdim=True) - torch.tensor(belows, dtype=c.dtype, device=c.device)[:, None]  # [B, V]
    ids = keep.any(0).nonzero()[:, 0]  # [C]: a candidate of some row
    out = torch.full_like(coarse, float("-inf"))
    scores = (h.to(rows.dtype) @ rows[ids].T).float()  # [B, C]
    out[:, ids] = scores.masked_fill_(~keep[:, ids], float("-inf"))
    return out


class TorchForward:
    """One drafted token a row through the low-bit copy: its layers in 4 bits where the model's weights sit on a 4-bit
    grid (the copy is then nearly the model), else in 8 bits on the CPU (a bf16-trained model's 4-bit copy agreed with
    it on ~48% of drafted tokens, too few to pay there; torch's CUDA int8 product is a plain loop a weight, slower than
    the model's own bf16 one: 4 bits on CUDA); the LM head in 4 bits (it only finds candidates). Its K/V land in the
    target's cache after the committed slots (scratch the verify overwrites)."""

    @classmethod
    def of(cls, dec) -> TorchForward | None:
        weights = [w for L in dec.layers for w in (L.qkv.weight, L.o.weight, L.gate_up.weight, L.down.weight)]
        head = dec.lm_head.weight
        takes = int4_kernel(head.device) and all(quantizable(w) for w in (*weights, head)) \
            and (head.device.type != "cpu" or hasattr(torch.ops.aten, "_weight_int8pack_mm"))
        if not takes:
            return None
        try:
            return cls(dec)
        except RuntimeError:  # an older torch whose int4 kernel refuses these shapes: no portable draft
            return None

    def __init__(self, dec, bits: int | None = None):
        self.dec = dec
        self.device = dec.lm_head.weight.device
        first = dec.layers[0]
        self.bits = bits or (4 if self.device.type != "cpu" or on_grid(
            [first.qkv.weight, first.o.weight, first.gate_up.weight, first.down.weight]) else 8)
        Lin = Int4Linear if self.bits == 4 else Int8Linear
        self.layers = [_Layer(L, Lin) for L in dec.layers]
        self.norm = _Norm(dec.norm)
        self.head = Int4Linear(dec.lm_head.weight)
        self.rows = dec.lm_head.weight  # [V, H]: rescore's
        self.caches: list = []
        self.positions: list[int] = []  # each row's root position
        self.cos = self.sin = None  # [B, k, 1, D] bf16 of the draft's positions
        self.static = None  # quant_static.StaticDraft where one row's depth is a CUDA graph (quant_draft.quantized)

    def begin(self, caches: list, positions: list[int], k: int, owners: list | None = None) -> None:
        """A draft of k tokens for each row: its root at positions[b], over caches[b] (anything with k, v
        [Lyr, Hkv, S, D] and length: a KVCache, or a batched sequence's one page); owners: RingForward's."""
        self.caches, self.positions = caches, positions
        dev = self.device
        like = torch.empty((1, 1, self.dec.head_dim), dtype=BF16, device=dev)
        pos = torch.tensor(positions, device=dev)[:, None] + torch.arange(k, device=dev)  # [B, k]
        cos, sin = self.dec.rotary(like, pos)  # [B, k, D] each
        self.cos, self.sin = cos[:, :, None, :].to(BF16), sin[:, :, None, :].to(BF16)  # [B, k, 1, D]

    @torch.inference_mode()
    def logits(self, i: int, tokens: list[int], counts: list, thetas: list[float], belows: list[float]) -> torch.Tensor:
        """Each row's rescored logits after its token, the i-th of its draft (i = 0: the root).

        # counts[b]: [V] int32 or None -> [B, V] float32 (-inf outside each row's candidates)
        """
        dec, B = self.dec, len(tokens)
        if B == 1 and self.static is not None:
            cache = self.caches[0]
            out = self.static.coarse(cache, tokens[0], self.positions[0] + i, cache.length + i)  # None: it failed
            if out is not None:
                return rescore(out[1], counts, out[0], self.rows, thetas, belows)
        nq, nkv, D = dec.n_q, dec.n_kv, dec.head_dim
        x = dec.embed(torch.tensor(tokens, device=self.device)).to(BF16)  # [B, H]
        cos, sin = self.cos[:, i], self.sin[:, i]  # [B, 1, D]
        for j, L in enumerate(self.layers):
            qk, v = rotated_qkv(L, x, cos, sin, nq, nkv, D)  # [B, nq + nkv, D], [B, nkv, D]
            out = torch.empty((B, nq, D), dtype=BF16, device=self.device)
            for b, cache in enumerate(self.caches):
                slot = cache.length + i
                cache.k[j, :, slot] = qk[b, nq:]
                cache.v[j, :, slot] = v[b]
                out[b] = self._attend(cache, j, qk[b, :nq], slot + 1, L.scaling)
            x = x + L.o(out.view(B, nq * D))
            x = mlp_residual(L, x, dec.inter)
        h = self.norm(x)
        coarse = self.head(h).float()  # [B, V]
        return rescore(coarse, counts, h, self.rows, thetas, belows)

    @staticmethod
    def _attend(cache, layer: int, q: torch.Tensor, n: int, scaling: float) -> torch.Tensor:
        """q over slots [0, SINKS) and the last WINDOW of [0, n) (all of them while n <= SINKS + WINDOW).

        # q: [Hq, D] bf16 -> [Hq, D] bf16
        """
        ck, cv = cache.k[layer], cache.v[layer]  # [Hkv, S, D]
        Hkv, D = ck.shape[0], ck.shape[2]
        qg = q.reshape(Hkv, -1, D).to(ck.dtype)  # query head h = kv_head * G + g
        if n <= SINKS + WINDOW:
            o = F.scaled_dot_product_attention(qg[None], ck[None, :, :n], cv[None, :, :n], scale=scaling)[0]
        else:
            o1, lse1 = attend_lse(qg, ck[:, :SINKS], cv[:, :SINKS], scaling)
            o2, lse2 = attend_lse(qg, ck[:, n - WINDOW : n], cv[:, n - WINDOW : n], scaling)
            o, _ = merge_states(o1, lse1, o2, lse2)
        return o.reshape(-1, D).to(BF16)
