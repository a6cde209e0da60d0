"""4-bit copies of a model's linear weights for the quantized self-drafter: round-to-nearest, asymmetric, one scale and
minimum per output column and group of 32 inputs, both float16 (GGUF's Q4_1 grid), packed as cpu_kernels.c gemv_q4 reads.

quantize(W) -> (packed bytes, the float weights they stand for); the second is the reference tests compare with.
"""

from __future__ import annotations

import torch

GROUP = 32  # cpu_kernels.c QG


FP16_MAX = 65504.0


def quantizable(weight: torch.Tensor) -> bool:
    """Whether gemv_q4 takes this weight: [N, K] with K a multiple of the group, its minimums and scales
    within float16's range."""
    return weight.dim() == 2 and weight.shape[1] % GROUP == 0 and bool(weight.abs().amax() < FP16_MAX / 2)


def grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 4-bit grid of each row and group of GROUP inputs: codes q, float16 scale d and minimum m, w ~ d * q + m.

    # weight: [N, K] -> q: [N, K] uint8 in 0..15, d, m: [N, K / GROUP] float16
    """
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"quantized packing needs inputs in groups of {GROUP}, got {K}")
    g = weight.float().view(N, K // GROUP, GROUP)
    low, high = g.amin(dim=-1), g.amax(dim=-1)  # [N, G]
    top = 15
    d, low = ((high - low) / top).half(), low.half()  # the codes are rounded against the stored scales
    df, lowf = d.float(), low.float()
    q = ((g - lowf[..., None]) / torch.where(df > 0, df, 1.0)[..., None]).round_().clamp_(0, top).to(torch.uint8)
    return q.view(N, K), d, low


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """# weight: [N, K] -> packed: [ceil(N/16), K/32, 320] uint8 (per column block and group: 256 code bytes, 16
    float16 scales d, 16 float16 minimums m (cpu_kernels.c)), dequantized: [N, K] float32 (d * q + m)"""
    N, K = weight.shape
    blocks, G = -(-N // 16), K // GROUP
    w = weight.new_zeros((blocks * 16, K), dtype=torch.float32)
    w[:N] = weight.float()
    q, d, low = grid(w)
    q, d, low = q.view(blocks, 16, G, GROUP), d.view(blocks, 16, G), low.view(blocks, 16, G)
    dequantized = (q.float() * d.float()[..., None] + low.float()[..., None]).view(blocks * 16, K)[:N]
    # codes: pair kp of a group holds element j = column j // 2's input 2 kp + j % 2; chunk c = pairs 2c (low nibble)
    # and 2c + 1 (high nibble)
    pairs = q.view(blocks, 16, G, GROUP // 2, 2).permute(0, 2, 3, 1, 4).reshape(blocks, G, GROUP // 2, 32)
    codes = (pairs[:, :, 0::2] | (pairs[:, :, 1::2] << 4)).reshape(blocks, G, GROUP * 8)
    as_bytes = lambda t: t.permute(0, 2, 1).contiguous().view(torch.uint8).reshape(blocks, G, 32)  # noqa: E731
    packed = torch.cat((codes, as_bytes(d), as_bytes(low)), dim=-1).contiguous()
    return packed, dequantized
