"""The int8 copy of a bf16 KV cache that the quantized self-drafter attends (cpu_kernels.c q8_*: its layout, coding and
attention); slots [0, upto) hold the codes of the cache's committed slots, synced a step's new slots at a time.
"""

from __future__ import annotations

import torch

from specrun.decoding.kernels.cpu_kernels import CpuKernels, ptr


class KVCodes:
    """Per layer and KV head (q8_bytes' layout): K codes in tiles of 16 keys, V codes in key pairs, each row's scale
    and its K codes' sum. Committed slots do not change, so sync codes only the slots committed since."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int):
        self.Hkv, self.D = kv_heads, head_dim
        self.cap = -(-capacity // 16) * 16  # whole tiles
        self.data = torch.zeros((layers, kv_heads * self.cap * (2 * head_dim + 12)), dtype=torch.uint8)
        self.upto = 0

    def sync(self, kernels: CpuKernels, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Codes for the slots [upto, length) of the bf16 cache k, v (length below upto: a new sequence, all again).

        # k, v: [Lyr, Hkv, cap, D] (each layer contiguous, K and V alike)
        """
        start = self.upto if length >= self.upto else 0
        if length > start:
            L, Hkv, cap, D = k.shape
            assert k.dtype == v.dtype == torch.bfloat16 and k.stride() == v.stride() and k[0].is_contiguous()
            assert (L, Hkv, D) == (self.data.shape[0], self.Hkv, self.D) and cap <= self.cap and length <= cap
            kernels.quantize_kv_q8(k.data_ptr(), v.data_ptr(), cap, k.stride(0), self.data.data_ptr(), self.cap, L,
                                   Hkv, D, start, length, torch.get_num_threads())
        self.upto = length

    def attend(self, kernels: CpuKernels, q: torch.Tensor, start: int, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """The quantized self-drafter's attention over a one-layer copy (codes of slots [0, start + T)), in chunks of
        keys merged by log-sum-exp (decode_layers_q4 runs its parts for all sequences at once).

        # q: [T, Hq, D] bf16, mask: [T, T] bool or None (T == 1) -> [T, Hq, D] bf16
        """
        q = q.contiguous()
        T, Hq, D = q.shape
        assert q.dtype == torch.bfloat16 and self.data.shape[0] == 1 and (mask is not None or T == 1)
        assert D == self.D and Hq % self.Hkv == 0 and start + T <= self.cap, (D, Hq, start + T, self.cap)
        mask = None if mask is None else mask.contiguous()
        out = torch.empty_like(q)
        if kernels.attend_split_q8(q.data_ptr(), self.data.data_ptr(), self.cap, ptr(mask), out.data_ptr(), T, Hq,
                                   self.Hkv, D, start, scale, torch.get_num_threads()) != 0:
            raise MemoryError("attend_split_q8: no memory for its chunks' sums")
        return out
