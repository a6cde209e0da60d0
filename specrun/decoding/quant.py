"""4- and 8-bit copies of a model's linear weights for the quantized self-drafter: round-to-nearest, asymmetric, one
scale and minimum per output column and group of 32 inputs (GGUF's Q4_1 / Q8_1 grid), packed as cpu_kernels.c
gemv_q4 / gemv_q8 read them.

quantize(W, bits) -> (packed bytes, the float weights they stand for); the second is the reference tests compare with.
"""

from __future__ import annotations

import torch

GROUP = 32  # cpu_kernels.c QG


def quantizable(weight: torch.Tensor) -> bool:
    """Whether gemv_q4 / gemv_q8 take this weight: [N, K] with K a multiple of the group."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0


def quantize(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """# weight: [N, K] -> packed: [ceil(N/16), K/32, 64 bits + 128] uint8 (per column block and group: 64 bits code
    bytes, 16 float32 scales d, 16 shifted minimums m' (cpu_kernels.c)), dequantized: [N, K] float32 (d * q + m)"""
    if bits not in (4, 8):
        raise ValueError(f"quantize packs 4 or 8 bits, not {bits}")
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"quantized packing needs inputs in groups of {GROUP}, got {K}")
    blocks, G = -(-N // 16), K // GROUP
    w = weight.new_zeros((blocks * 16, K), dtype=torch.float32)
    w[:N] = weight.float()
    g = w.view(blocks, 16, G, GROUP)
    low, high = g.amin(dim=-1), g.amax(dim=-1)  # [B, 16, G]
    top = 2 ** bits - 1
    d = (high - low) / top
    q = ((g - low[..., None]) / torch.where(d > 0, d, 1.0)[..., None]).round_().clamp_(0, top).to(torch.uint8)
    dequantized = (q.float() * d[..., None] + low[..., None]).view(blocks * 16, K)[:N]
    # codes: pair kp of a group holds element j = column j // 2's input 2 kp + j % 2; 4 bits: chunk c = pairs 2c (low
    # nibble) and 2c + 1 (high nibble); 8 bits: chunk c = pair c
    pairs = q.view(blocks, 16, G, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(blocks, G, GROUP // 2, 32)
    if bits == 4:
        pairs = pairs[:, :, 0::2] | (pairs[:, :, 1::2] << 4)
    codes = pairs.reshape(blocks, G, GROUP * 2 * bits)
    as_bytes = lambda t: t.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(blocks, G, 64)  # noqa: E731
    offset = 128.0 if bits == 4 else 2176.0  # the kernel's codes are OFFSET + q (cpu_kernels.c): m' = m - OFFSET d
    packed = torch.cat((codes, as_bytes(d), as_bytes(low - offset * d)), dim=-1).contiguous()
    return packed, dequantized
