"""The memory roofline of one decode step: bytes a token must read (weights + KV) over the device's measured bandwidth.

roofline(lm, context, probes) -> dict; a plain AR step can be no faster than bytes / bandwidth, so AR's share of it is
its tok/s x bytes / bandwidth, each repeat against the probes taken just before and after it (a shared host's
bandwidth moves by 2x within minutes).
"""

from __future__ import annotations

import statistics
import time

import torch

from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.paged_runner import kv_bytes_per_token


def read_bandwidth(device: torch.device, megabytes: int = 512, repeats: int = 5) -> float:
    """Best of `repeats` full reads (a sum) of a buffer far larger than the caches, in bytes/s, with torch's threads."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first read also faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def step_weight_bytes(lm) -> int:
    """Bytes of weights one decode step reads: every layer's matrices and norms, the final norm and the LM head."""
    dec = FusedDecoder.of(lm.model)
    total = dec.lm_head.weight.nbytes + sum(p.nbytes for p in dec.norm.parameters())
    for L in dec.layers:
        total += sum(lin.weight.nbytes + (lin.bias.nbytes if lin.bias is not None else 0)
                     for lin in (L.qkv, L.o, L.gate_up, L.down))
        total += sum(p.nbytes for m in (L.ln1, L.ln2, L.q_norm, L.k_norm) if m is not None for p in m.parameters())
    return total


def roofline(lm, mean_context: int, probes: list[float] | None = None) -> dict:
    """Weights and KV read per token at `mean_context` keys, the bandwidth (the median of `probes`, read_bandwidth's
    results taken around the runs; one probe now if none), and the step time they bound."""
    weights = step_weight_bytes(lm)
    kv = kv_bytes_per_token(lm.model.config, lm.dtype) * mean_context
    probes = list(probes) if probes else [read_bandwidth(lm.device)]
    bandwidth = statistics.median(probes)
    return {"weight_bytes": weights, "kv_bytes": kv, "mean_context": mean_context, "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_probes": probes, "min_seconds_per_token": (weights + kv) / bandwidth}


def share(roof: dict, tokens_per_s: float | None) -> float | None:
    """What fraction of the roofline a run of tokens_per_s reaches (1.0 = every step reads at full bandwidth)."""
    return None if not tokens_per_s else roof["min_seconds_per_token"] * tokens_per_s


def repeat_shares(roof: dict, tokens_per_s: list[float]) -> list[float] | None:
    """Each repeat's share against the mean of the probes before and after it (probes: one more than repeats), or
    None where the probes do not bracket the repeats."""
    probes = roof["bandwidth_probes"]
    if len(probes) != len(tokens_per_s) + 1:
        return None
    per_token = roof["weight_bytes"] + roof["kv_bytes"]
    return [per_token * 2 / (probes[i] + probes[i + 1]) * t for i, t in enumerate(tokens_per_s)]
