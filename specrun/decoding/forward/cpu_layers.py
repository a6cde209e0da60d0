"""All decoder layers of a CPU bf16 or float32 forward in one call to cpu_kernels.c (decode_layers_bf16 / _f32):
norms, products, rotary, cache writes, attention, activation and residuals, no torch op in between; each step rounds
where decoder.py's ops do. A batched worker's forward too (batch): its sequences' rows share the products, each row
computed alone, and each sequence attends its own page, so every row gets its solo run's values.

CpuLayers.of(decoder, kernels) -> None where the layers are not the plain Llama shape it computes (qk-norm, another
activation or norm, weights not packed in the activations' dtype); decoder.py keeps its torch path then.
CpuLayers.quantized(decoder, kernels): the same layers over 4-bit copies of the weights (quant.py; the self-drafter's).
"""

from __future__ import annotations

import ctypes

import torch

from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.forward.kv_codes import KVCodes
from specrun.decoding.forward.quant import quantizable, quantize
from specrun.decoding.kernels.cpu_kernels import CpuKernels, ptr

_P = ctypes.c_void_p


class _LayerPtrs(ctypes.Structure):  # cpu_kernels.c layer_t
    _fields_ = [(name, _P) for name in ("ln1", "ln2", "qkv", "o", "gate_up", "down", "b_qkv", "b_o", "b_gate_up",
                                        "b_down")]


class _Seq(ctypes.Structure):  # cpu_kernels.c seq_t
    _fields_ = [(name, ctypes.c_long) for name in ("r0", "T", "start", "cap", "layer_stride")] + \
               [("k", _P), ("v", _P), ("mask", _P), ("q8", _P), ("q8_cap", ctypes.c_long)]


def _seq(r0: int, T: int, start: int, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         dtype: torch.dtype, q8: KVCodes | None = None) -> _Seq:
    """One sequence's rows and cache (and the int8 copy the quantized layers attend). # k, v: [Lyr, Hkv, cap, D] views
    (layers may be strided, each layer contiguous), mask: [T, T] bool contiguous or None (T == 1)"""
    if start + T > k.shape[2]:
        raise RuntimeError(f"KV cache overflow: need {start + T} slots, have {k.shape[2]}")
    if k.dtype != dtype or v.dtype != dtype or (mask is not None and mask.dtype != torch.bool):
        raise TypeError(f"decode_layers writes {dtype} K/V with a bool mask, got {k.dtype} / {v.dtype} / "
                        f"{None if mask is None else mask.dtype}")
    if k.stride() != v.stride() or not (k[0].is_contiguous() and v[0].is_contiguous()) \
            or (mask is not None and not mask.is_contiguous()):
        raise ValueError("decode_layers reads each layer's K/V and the mask contiguous, K and V alike")
    if q8 is not None and (q8.cap < k.shape[2] or q8.data.shape[0] != k.shape[0]):
        raise ValueError(f"the int8 copy holds {q8.data.shape[0]} layers of {q8.cap} slots, the cache "
                         f"{k.shape[0]} of {k.shape[2]}")
    return _Seq(r0, T, start, k.shape[2], k.stride(0), k.data_ptr(), v.data_ptr(), ptr(mask),
                None if q8 is None else q8.data.data_ptr(), 0 if q8 is None else q8.cap)


def _plain_rms_norm(norm, dtype: torch.dtype) -> bool:
    """HF's Llama-style RMSNorm (weight * normalized, the weight as is): llama, mistral, qwen2 and qwen3 norms."""
    return type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "variance_epsilon") \
        and getattr(norm, "weight", None) is not None and norm.weight.dtype == dtype


_LINEARS = ("qkv", "o", "gate_up", "down")


class CpuLayers:
    def __init__(self, dec, kernels: CpuKernels, quantized: bool = False):
        self.kernels = kernels
        self.dtype = torch.bfloat16 if quantized else dec.embed.weight.dtype
        self.quantized = quantized
        self.run_layers = kernels.decode_layers_q4 if quantized else kernels.decode_layers[self.dtype]
        self.q4: list[torch.Tensor] = []  # the 4-bit packs the pointers point into (kept alive here)
        L0 = dec.layers[0]
        self.H, self.I = L0.ln1.weight.shape[0], dec.inter
        self.Hq, self.Hkv, self.D = dec.n_q, dec.n_kv, dec.head_dim
        self.eps, self.scale = float(L0.ln1.variance_epsilon), float(L0.scaling)
        self.ptrs = (_LayerPtrs * len(dec.layers))()
        for p, L in zip(self.ptrs, dec.layers):
            p.ln1, p.ln2 = L.ln1.weight.data_ptr(), L.ln2.weight.data_ptr()
            for name in _LINEARS:
                lin = getattr(L, name)
                if quantized:
                    self.q4.append(quantize(lin.weight)[0])
                setattr(p, name, self.q4[-1].data_ptr() if quantized else lin._own.data_ptr())
                setattr(p, "b_" + name, ptr(lin._bias32))

    @classmethod
    def of(cls, dec, kernels: CpuKernels | None) -> CpuLayers | None:
        """The one-call layers of FusedDecoder dec, or None where they would not compute what its torch path does."""
        return cls(dec, kernels) if cls._takes(dec, kernels) else None

    @staticmethod
    def _takes(dec, kernels: CpuKernels | None) -> bool:
        dtype = dec.embed.weight.dtype  # the activations' (HF's rotary follows x's)
        if kernels is None or not dec.layers or dtype not in kernels.decode_layers:
            return False
        first = dec.layers[0]
        for L in dec.layers:  # one scale and eps for all (passed once), SiLU, plain norms, packed weights
            if L.q_norm is not None or type(L.act).__name__ not in ("SiLUActivation", "SiLU") \
                    or not (_plain_rms_norm(L.ln1, dtype) and _plain_rms_norm(L.ln2, dtype)) \
                    or any(lin._own is None or lin._own.dtype != dtype
                           for lin in (L.qkv, L.o, L.gate_up, L.down)) \
                    or L.scaling != first.scaling \
                    or not L.ln1.variance_epsilon == L.ln2.variance_epsilon == first.ln1.variance_epsilon:
                return False
        return CpuKernels.attends(dec.head_dim, dec.n_q, dec.n_kv)

    @classmethod
    def quantized(cls, dec, kernels: CpuKernels | None) -> CpuLayers | None:
        """dec's layers over 4-bit copies of its weights, bf16 activations, as CpuLayers.of computes them otherwise;
        None where the kernels do not take the model (see of), its final norm is not a plain RMSNorm (the drafter's
        is kernels.rms_norm) or a weight's inputs are not in groups of 32."""
        if not cls._takes(dec, kernels) or dec.embed.weight.dtype != torch.bfloat16 \
                or not _plain_rms_norm(dec.norm, torch.bfloat16) or not all(
                quantizable(getattr(L, name).weight) for L in dec.layers for name in _LINEARS):
            return None
        return cls(dec, kernels, quantized=True)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int,
                 new_mask: torch.Tensor | None, queries: list | None = None) -> torch.Tensor:
        """Run every layer over T new tokens, writing their K/V at slots [start, start + T); with a queries list, each
        layer's rotated q [Hq, T, D] is appended to it (as decoder.py's torch path does).

        # x: [T, H] (embedded), cos/sin: [T, D], new_mask: [T, T] bool (None for T == 1) -> x: [T, H]; all but the mask
        # in the layers' dtype (bf16 or float32)
        """
        mask = None if new_mask is None else new_mask.contiguous()
        seq = _seq(0, x.shape[0], start, cache.k, cache.v, mask, self.dtype)
        x, kept = self._run(x, cos, sin, [seq], start + x.shape[0], queries is not None)
        if queries is not None:
            queries.extend(q.transpose(0, 1) for q in kept)
        return x

    def rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list, starts: list[int],
             q8: list[KVCodes | None], queries: list | None = None) -> torch.Tensor:
        """One new token for each of several sequences through the quantized layers (the 4-bit draft's forward): row b
        over caches[b] (anything with k, v [Lyr, Hkv, cap, D]) at slot starts[b], attending q8[b], the int8 copy of
        its slots [0, starts[b]) (the new slot's codes added), or where None the bf16 cache. With a queries list, the
        rows' rotated queries [Lyr, B, Hq, D] are appended to it.

        # x: [B, H] bf16 (embedded), cos/sin: [B, D] -> x: [B, H]
        """
        if not self.quantized:
            raise ValueError("only the quantized layers attend an int8 copy")
        seqs = [_seq(b, 1, start, c.k, c.v, None, self.dtype, codes)
                for b, (c, start, codes) in enumerate(zip(caches, starts, q8))]
        x, kept = self._run(x, cos, sin, seqs, max(starts) + 1, queries is not None)
        if queries is not None:
            queries.append(kept)
        return x

    def batch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              spans: list[tuple[int, int, int, int, torch.Tensor | None]], queries: list | None = None) -> torch.Tensor:
        """A batched worker's forward: every sequence's rows over its one page of the pool, each row as its solo run
        computes it; with a queries list, each layer's q [N, Hq, D] is appended to it (as paged_attention.py does).

        # x: [N, H] (embedded, packed), k/v: the pool [Lyr, Pg, Hkv, P, D], spans: (page, first row, rows, committed
        # slots, tree mask [rows, rows] or None) per sequence -> x: [N, H]
        """
        masks = [None if m is None else m.contiguous() for *_, m in spans]  # alive until the call returns
        seqs = [_seq(r0, T, start, k[:, page], v[:, page], m, self.dtype)
                for (page, r0, T, start, _), m in zip(spans, masks)]
        x, kept = self._run(x, cos, sin, seqs, max(start + T for _, _, T, start, _ in spans), queries is not None)
        if queries is not None:
            queries.extend(kept)
        return x

    def _run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqs: list[_Seq], keys: int,
             keep_queries: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """decode_layers over seqs -> the new x, and each layer's rotated queries [Lyr, T, Hq, D] if kept.
        keys: the most keys a sequence attends (the attention's scratch)."""
        T, dt = x.shape[0], self.dtype
        if x.dtype != dt or cos.dtype != dt or sin.dtype != dt:
            raise TypeError(f"decode_layers reads {dt} activations and rotary tables, got {x.dtype} / {cos.dtype}")
        x = x.clone(memory_format=torch.contiguous_format)  # updated in place
        H, I, Hq, Hkv, D = self.H, self.I, self.Hq, self.Hkv, self.D
        cos, sin = cos.contiguous(), sin.contiguous()
        work = torch.empty(T * (2 * H + (Hq + 2 * Hkv) * D + 2 * Hq * D + 3 * I), dtype=dt)
        kept = torch.empty((len(self.ptrs), T, Hq, D), dtype=dt) if keep_queries else None
        most = max(s.T for s in seqs)
        scores = CpuKernels.attend_scratch(most, Hq, Hkv, keys - most, torch.get_num_threads())
        arr = (_Seq * len(seqs))(*seqs)
        self.run_layers(ctypes.addressof(self.ptrs), len(self.ptrs), x.data_ptr(), T, H, I, Hq, Hkv, D,
                        ctypes.addressof(arr), len(seqs), cos.data_ptr(), sin.data_ptr(), self.eps, self.scale,
                        work.data_ptr(), scores.data_ptr(), ptr(kept), torch.get_num_threads())
        return x, kept
