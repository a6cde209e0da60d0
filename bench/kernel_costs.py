"""What our CPU kernels cost on smollm2's shapes (30 layers, 9 query and 3 KV heads of 64, hidden 576, MLP 1,536), each
layer's operands distinct so that they come from memory as in a step; milliseconds for the 30 layers, medians.

    python bench/kernel_costs.py attention --keys 2048,32768 --rows 1,6   # our bf16 attention: T new rows at S keys
    python bench/kernel_costs.py q4 --rows 1,4,8                         # the self-draft's 4-bit products and head

It needs our kernels (AVX-512 BF16 and VNNI, a C compiler); its first line reads 256 MB to say the bandwidth now.
"""

from __future__ import annotations

import argparse
import time

import torch

from specrun.decoding.forward.quant import quantize
from specrun.decoding.kernels.cpu_kernels import cpu_kernels

LAYERS, HQ, HKV, D, H, I, V = 30, 9, 3, 64, 576, 1536, 49152


def median_ms(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def probe_gbs() -> float:
    """A plain read of 256 MB (torch's sum over int64 words), the best of three: the host's memory bandwidth now."""
    x = torch.ones(32 << 20, dtype=torch.int64)
    return (x.numel() * 8) / min(median_ms(x.sum, 1) for _ in range(3)) / 1e6


def attention(kernels, keys: list[int], rows: list[int], repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for S in keys:
        cache = [(torch.randn(HKV, S + 64, D, generator=gen).bfloat16(), torch.randn(HKV, S + 64, D, generator=gen)
                  .bfloat16()) for _ in range(LAYERS)]
        kv_bytes = LAYERS * 2 * HKV * S * D * 2
        for T in rows:
            q = torch.randn(T, HQ, D, generator=gen).bfloat16()
            mask = None if T == 1 else torch.ones(T, T, dtype=torch.bool).tril()
            ms = median_ms(lambda: [kernels.attend(q, k, v, S - T, mask, D**-0.5) for k, v in cache], repeat)
            print(f"attention  {S:>7} keys {T:>3} rows: {ms:8.2f} ms  ({kv_bytes / ms / 1e6:5.1f} GB/s of K/V)")


def q4(kernels, rows: list[int], repeat: int) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(HQ * D + 2 * HKV * D, H), (H, HQ * D), (2 * I, H), (H, I)]  # qkv, o, gate_up, down
    layers = [[(quantize(torch.randn(n, k, generator=gen) * 0.05)[0], n, k) for n, k in shapes]
              for _ in range(LAYERS)]
    head = quantize(torch.randn(V, H, generator=gen) * 0.05)[0]
    weight_bytes = sum(p.numel() for layer in layers for p, _, _ in layer)
    for M in rows:
        x = {k: torch.randn(M, k, generator=gen).bfloat16() for k in (H, I)}
        ms = median_ms(lambda: [kernels.gemv_q4(x[k], p, n) for layer in layers for p, n, k in layer], repeat)
        head_ms = median_ms(lambda: kernels.gemv_q4(x[H], head, V), repeat)
        print(f"4-bit products {M:>2} rows: layers {ms:6.2f} ms ({weight_bytes / ms / 1e6:5.1f} GB/s), "
              f"head {head_ms:5.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["attention", "q4"])
    ap.add_argument("--keys", default="2048,8192,32768", help="attention: committed slots, comma list")
    ap.add_argument("--rows", default=None, help="rows a call, comma list (attention 1,6; q4 1,4,8)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("our CPU kernels do not load here (they need AVX-512 BF16 and VNNI and a C compiler)")
    torch.set_num_threads(a.threads)
    print(f"probe: {probe_gbs():.1f} GB/s (a read of 256 MB); {a.threads} threads")
    rows = [int(r) for r in (a.rows or ("1,6" if a.what == "attention" else "1,4,8")).split(",")]
    if a.what == "attention":
        attention(kernels, [int(s) for s in a.keys.split(",")], rows, a.repeat)
    else:
        q4(kernels, rows, a.repeat)


if __name__ == "__main__":
    main()
