"""Our own CPU kernels (cpu_kernels.c, AVX-512 BF16): bf16 and float32 linear layers, attention and whole decoder
layers (the quantized self-drafter's too, and its head's rescoring), the argmax / top-k of float32 logits rows, and
sampled tokens (penalty, temperature, min-p, Gumbel-max), compiled once (kernel_build.py).

cpu_kernels() -> CpuKernels | None: None where they cannot run (no avx512_bf16, no C compiler, SPECRUN_CPU_KERNELS=0,
a failed build); callers keep torch's path then. The library is built into the specrun cache, atomically.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import warnings
from pathlib import Path

import torch

from specrun.decoding.kernels.kernel_build import build, cpu_has_bf16_dot
from specrun.models.cache import cache_root

Patches = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, cols, present): per-node overrides of presence

SOURCE = Path(__file__).with_name("cpu_kernels.c")


P, L, I, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float  # the C functions' argument types


def _bind(f, argtypes: list, restype=None):
    """A C function of the library with its signature set (ctypes converts and checks the arguments by it)."""
    f.argtypes, f.restype = argtypes, restype
    return f


class CpuKernels:
    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))  # CDLL releases the GIL during calls; OpenMP resolves to torch's loaded runtime
        self._gemv = {torch.bfloat16: lib.gemv_bf16, torch.float32: lib.gemv_f32}
        self._gemv_q4 = {False: lib.gemv_q4, True: lib.gemv_q4_q8}
        for f in (*self._gemv.values(), *self._gemv_q4.values()):
            _bind(f, [P] * 4 + [L] * 3 + [I])
        self._attend = {torch.bfloat16: lib.attend_bf16, torch.float32: lib.attend_f32}
        for f in self._attend.values():
            _bind(f, [P] * 3 + [L] + [P] * 2 + [L] * 5 + [F, P, I])
        # called by kv_codes.KVCodes, which owns the int8 copy they read and write (the 4-bit draft's attention)
        self.attend_split_q8 = _bind(lib.attend_split_q8, [P] * 2 + [L] + [P] * 2 + [L] * 5 + [F, I], I)
        self.quantize_kv_q8 = _bind(lib.quantize_kv_q8, [P] * 2 + [L] * 2 + [P] + [L] * 6 + [I])
        self._rms_norm = _bind(lib.rms_norm_rows_bf16, [P] * 3 + [L] * 2 + [F])
        self._rescore = _bind(lib.rescore_rows_bf16, [P, L, L] + [P] * 3 + [L] + [P] * 4 + [I])
        # called by cpu_layers.CpuLayers, which owns their arguments
        self.decode_layers = {torch.bfloat16: lib.decode_layers_bf16, torch.float32: lib.decode_layers_f32}
        self.decode_layers_q4 = lib.decode_layers_q4  # bf16 activations over quant.py's 4-bit weights
        for f in (*self.decode_layers.values(), self.decode_layers_q4):
            _bind(f, [P, I, P] + [L] * 6 + [P, L] + [P] * 2 + [F] * 2 + [P] * 3 + [I])
        self._argmax = _bind(lib.argmax_f32, [P, L, L, P, I])
        self._topk = _bind(lib.topk_f32, [P, L, L, I, P, I], I)
        self._sample = _bind(lib.sample_minp_f32, [P, L, L] + [P] * 4 + [L] + [F] * 3 + [P] * 4 + [I], I)
        self._draft_level = _bind(lib.draft_level_f32, [P, L, L] + [P] * 2 + [F] * 3 + [ctypes.c_uint64] * 2
                                  + [ctypes.c_int64, I] + [P] * 4 + [I], I)

    @staticmethod
    def packs(weight: torch.Tensor) -> bool:
        """Whether gemv takes this weight: [N, K] on the CPU, bf16 with K even or float32."""
        return weight.device.type == "cpu" and weight.dim() == 2 \
            and (weight.dtype == torch.float32 or weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """The layout gemv reads (cpu_kernels.c): column blocks of 16, zero-padded; bf16 keeps input pairs innermost.

        # weight: [N, K] bf16 -> [ceil(N/16), K/2, 16, 2]; float32 -> [ceil(N/16), K, 16]
        """
        N, K = weight.shape
        blocks = -(-N // 16)
        padded = weight.new_zeros((blocks * 16, K))
        padded[:N] = weight
        if weight.dtype == torch.float32:
            return padded.view(blocks, 16, K).transpose(1, 2).contiguous()
        return padded.view(blocks, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()

    def gemv(self, x: torch.Tensor, packed: torch.Tensor, n: int, b: torch.Tensor | None) -> torch.Tensor:
        """x W^T (+ b) for W = the n-row weight `packed` came from, in its dtype; float32 accumulation (bf16: rounded
        to bf16 once), every output summed in one order whatever the other rows.

        # x: [M, K] (packed's dtype), packed: pack(W [n, K]), b: [n] float32 or None -> [M, n]
        """
        x = x.contiguous()
        M, K = x.shape
        assert x.dtype == packed.dtype, (x.dtype, packed.dtype)
        assert b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.numel() == n), "bias: float32 [n]"
        y = torch.empty((M, n), dtype=x.dtype)
        self._gemv[x.dtype](x.data_ptr(), packed.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), M, n,
                            K, torch.get_num_threads())
        return y

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF's Llama RMSNorm of each row but for the sum of squares' order (decode_layers' norm). # x: [T, H] bf16,
        weight: [H] bf16 -> [T, H] bf16"""
        x = x.contiguous()
        assert x.dtype == weight.dtype == torch.bfloat16 and weight.is_contiguous() and weight.shape == x.shape[1:]
        out = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def rescore(self, coarse: torch.Tensor, counts: list, h: torch.Tensor, rows: torch.Tensor, thetas: list[float],
                belows: list[float]) -> tuple[torch.Tensor, list[int]]:
        """Row b: h[b]'s bf16-rounded logits (h[b] . rows[v]) for the tokens whose penalised coarse logit (thetas[b] on
        the tokens counts[b] counts; None: no penalty) is at least its best one less belows[b], -inf for the rest
        (rescore_bf16), and how many there are.

        # coarse: [B, V] bf16, counts[b]: [V] int32 or None, h: [B, H] bf16, rows: [V, H] bf16 -> [B, V] float32, B ints
        """
        coarse, h = coarse.contiguous(), h.contiguous()
        (B, V), (_, H) = coarse.shape, h.shape
        assert coarse.dtype == h.dtype == rows.dtype == torch.bfloat16 and rows.is_contiguous() \
            and h.shape[0] == B == len(counts) == len(thetas) == len(belows) and rows.shape == (V, H) \
            and H % 32 == 0 and all(t > 0.0 for t in thetas), (coarse.shape, h.shape, rows.shape, thetas)
        out, n, table = torch.empty((B, V), dtype=torch.float32), (ctypes.c_long * B)(), counts_table(counts, V)
        self._rescore(coarse.data_ptr(), B, V, table, h.data_ptr(), rows.data_ptr(), H, (ctypes.c_float * B)(*thetas),
                      (ctypes.c_float * B)(*belows), out.data_ptr(), n, torch.get_num_threads())
        return out, list(n)

    def gemv_q4(self, x: torch.Tensor, packed: torch.Tensor, n: int, b: torch.Tensor | None = None,
                int8_inputs: bool = False) -> torch.Tensor:
        """x W^T (+ b) in bf16 for the 4-bit W (quant.py) of n rows; float32 accumulation, rounded to bf16 once.
        int8_inputs: each row's inputs on an int8 grid per group of 32 first (gemv_q4_q8: faster, ~1% error).

        # x: [M, K] bf16, packed: quantize(W [n, K])[0], b: [n] float32 or None -> [M, n] bf16
        """
        x = x.contiguous()
        M, K = x.shape
        assert x.dtype == torch.bfloat16 and packed.dtype == torch.uint8 \
            and packed.shape == (-(-n // 16), K // 32, 320), (packed.shape, n, K)
        assert b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.numel() == n), "bias: float32 [n]"
        y = torch.empty((M, n), dtype=torch.bfloat16)
        self._gemv_q4[int8_inputs](x.data_ptr(), packed.data_ptr(), ptr(b), y.data_ptr(), M, n, K,
                                   torch.get_num_threads())
        return y

    @staticmethod
    def attend_scratch(T: int, Hq: int, Hkv: int, start: int, threads: int = 1) -> torch.Tensor:
        """attend's float32 scores for T rows after `start` slots: 16 rows (lanes) a block per KV head, and at least
        a block's for each of `threads` (decode_layers: a part for each thread)."""
        blocks = -(-(Hq // Hkv) * T // 16)
        return torch.empty((max(Hkv * blocks, threads), start + T, 16), dtype=torch.float32)

    @staticmethod
    def attends(head_dim: int, n_q: int, n_kv: int) -> bool:
        """Whether attend takes these shapes."""
        return head_dim % 32 == 0 and head_dim <= 256 and n_q % n_kv == 0

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """Rows of q attend the slots [0, start) of k/v and the new slots [start, start + T) under mask.

        # q: [T, Hq, D] bf16 or float32, k/v: [Hkv, cap, D] same dtype (one layer of the cache), mask: [T, T] bool or
        # None (T == 1) -> [T, Hq, D] q's dtype
        """
        q = q.contiguous()
        T, Hq, D = q.shape
        Hkv, cap = k.shape[0], k.shape[1]
        assert k.is_contiguous() and v.is_contiguous() and (mask is not None or T == 1)
        assert q.dtype == k.dtype == v.dtype and q.dtype in self._attend, (q.dtype, k.dtype, v.dtype)
        mask = None if mask is None else mask.contiguous()
        out = torch.empty_like(q)
        scores = self.attend_scratch(T, Hq, Hkv, start)
        self._attend[q.dtype](q.data_ptr(), k.data_ptr(), v.data_ptr(), cap, ptr(mask), out.data_ptr(), T, Hq, Hkv,
                              D, start, scale, scores.data_ptr(), torch.get_num_threads())
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(dim=-1) exactly (first NaN, else first maximal value). # x: [T, V] float32 -> [T] long"""
        x = x.contiguous()
        assert x.dtype == torch.float32 and x.dim() == 2, (x.dtype, x.shape)
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
        return out

    def topk(self, x: torch.Tensor, k: int) -> torch.Tensor | None:
        """Indices of each row's k largest values, descending, equal values in index order; None if a row has fewer than
        k that are not NaN. # x: [T, V] float32 -> [T, k] long"""
        x = x.contiguous()
        assert x.dtype == torch.float32 and x.dim() == 2 and 1 <= k <= min(TOPK_MAX, x.shape[1]), (x.shape, k)
        out = torch.empty((x.shape[0], k), dtype=torch.long)
        short = self._topk(x.data_ptr(), x.shape[0], x.shape[1], k, out.data_ptr(), torch.get_num_threads())
        return None if short else out

    def sample_minp(self, logits: torch.Tensor, counts: list, patches: Patches | None, theta: float, temperature: float,
                    min_p: float, seeds: list[int], positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """sampling.py's process_logits then sample for penalty theta on the tokens each row's counts count present
        (counts[t] > 0, overridden per row by patches; None: no penalty), temperature and min-p, under each row's seed,
        in one pass a row; None if a row has a NaN.

        # logits: [T, V] float32, counts[t]: [V] int32 or None, positions: [T] long -> choice [T] long, processed [T, V]
        """
        logits, positions = logits.contiguous(), positions.contiguous()
        T, V = logits.shape
        assert logits.dtype == torch.float32 and positions.dtype == torch.long and positions.shape == (T,)
        assert len(counts) == len(seeds) == T
        table = counts_table(counts, V)
        halves = (ctypes.c_uint64 * (2 * T))(*[h for s in seeds for h in (s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF)])
        rows = cols = vals = None
        if table is not None and patches is not None and patches[0].numel():
            rows, cols, vals = (patches[0].contiguous(), patches[1].contiguous(),
                                patches[2].to(torch.uint8).contiguous())
            assert rows.dtype == cols.dtype == torch.long and rows.shape == cols.shape == vals.shape
            assert 0 <= int(rows.min()) and int(rows.max()) < T and 0 <= int(cols.min()) and int(cols.max()) < V
        out, choice = torch.empty_like(logits), torch.empty(T, dtype=torch.long)
        bad = self._sample(logits.data_ptr(), T, V, table, ptr(rows), ptr(cols), ptr(vals),
                           0 if rows is None else rows.numel(), theta, temperature, math.log(min_p), halves,
                           positions.data_ptr(), out.data_ptr(), choice.data_ptr(), torch.get_num_threads())
        return None if bad else (choice, out)

    def draft_level(self, z: torch.Tensor, present: torch.Tensor | None, vocab: torch.Tensor, theta: float,
                    temperature: float, min_p: float, seed: int, position: int, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A recurrent drafter level's children (recurrent.py's _processed then _top_children, temperature + min-p) in one
        pass a row: the k best noisy kept scores, their columns, and each row's logsumexp over its kept scores; None if
        a row has a NaN. The noise is AR's at `position` for `seed`; present None: no penalty.

        # z: [R, N] float32, present: [N] bool or None, vocab: [N] long -> values [R, k], columns [R, k], lse [R]
        """
        z, vocab = z.contiguous(), vocab.contiguous()
        R, N = z.shape
        assert z.dtype == torch.float32 and vocab.dtype == torch.long and vocab.shape == (N,) and 1 <= k <= TOPK_MAX
        assert present is None or (present.dtype == torch.bool and present.is_contiguous() and present.shape == (N,))
        counts = None if present is None else present.to(torch.int32)  # sample_minp_f32's presence: counts > 0
        out, val = torch.empty_like(z), torch.empty((R, k), dtype=torch.float32)
        idx, lse = torch.empty((R, k), dtype=torch.long), torch.empty(R, dtype=torch.float32)
        bad = self._draft_level(z.data_ptr(), R, N, ptr(counts), vocab.data_ptr(), theta, temperature, math.log(min_p),
                                seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, position, k, out.data_ptr(),
                                val.data_ptr(), idx.data_ptr(), lse.data_ptr(), torch.get_num_threads())
        return None if bad else (val, idx, lse)


def ptr(t: torch.Tensor | None) -> int | None:
    """t's data pointer for a kernel argument, None (NULL) for None"""
    return None if t is None else t.data_ptr()


def counts_table(counts: list, V: int):
    """Each row's [V] int32 counts as a kernel's table of pointers (NULL for a row without), None if no row has any."""
    assert all(c is None or (c.dtype == torch.int32 and c.is_contiguous() and c.shape == (V,)) for c in counts)
    return None if all(c is None for c in counts) else (ctypes.c_void_p * len(counts))(*[ptr(c) for c in counts])


TOPK_MAX = 64  # topk_f32 keeps a row's candidates in a fixed array of this size


def row_kernels(x: torch.Tensor) -> CpuKernels | None:
    """The kernels for rows x, if they take them: CPU float32 [T, V] with V >= 1, where the kernels load."""
    ours = x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] >= 1
    return cpu_kernels() if ours else None


def topk_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(x, k).indices up to the order of equal values (ours: index order) and NaNs (ours skips them, torch ranks
    them largest; a row with fewer than k other values goes to torch), by our kernel for CPU float32 rows where the
    kernels load. For drafting (the recycling matrix), never for a sampled token. # x: [T, V] -> [T, k]"""
    kernels = row_kernels(x) if 1 <= k <= min(TOPK_MAX, x.shape[-1]) else None
    out = None if kernels is None else kernels.topk(x, k)
    return torch.topk(x, k, dim=-1).indices if out is None else out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), by our kernel for CPU float32 rows where the kernels load (the same indices; torch's CPU argmax
    is slow on vocabulary-wide rows: docs/benchmarks.md). # x: [T, V] -> [T] long"""
    kernels = row_kernels(x)
    return x.argmax(dim=-1) if kernels is None else kernels.argmax(x)


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process; None where they cannot run here (see the module doc)."""
    if os.environ.get("SPECRUN_CPU_KERNELS", "1") == "0" or not cpu_has_bf16_dot():
        return None
    try:
        return CpuKernels(build(SOURCE, cache_root() / "kernels"))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"specrun's CPU kernels are off ({e}); bf16 linears use oneDNN, the rest torch", stacklevel=2)
        return None
