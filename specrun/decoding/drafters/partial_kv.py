"""TokenSwift partial KV cache: per layer and KV head, |S| sink slots plus the top-(|B|-|S|) slots by importance.

importance_i = sum over the query heads of a KV group of q . k_i, q from the last committed token only. New tokens
overwrite the least important entries from the tail; in "dynamic" mode reaching the sinks triggers a full rebuild.
"""

from __future__ import annotations

from typing import Callable

import torch

from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.forward.paged_kv import SeqPages

KV_MODES = ("full", "partial", "dynamic")


def importance(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """# q: [Hq, D] query of the last committed token, k: [Hkv, L, D] (a cache layer's keys) -> [Hkv, L]"""
    Hq, D = q.shape
    Hkv = k.shape[0]
    group_q = q.reshape(Hkv, Hq // Hkv, D).sum(1)  # sum over the group's query heads: sum_h q_h . k = (sum_h q_h) . k
    return (k @ group_q.to(k.dtype)[:, :, None])[..., 0]  # a matmul a head: 5x an einsum over the keys transposed


def select_top(scores: torch.Tensor, budget: int, sinks: int) -> torch.Tensor:
    """Sinks first, then the rest by importance descending (ties: lower slot first).

    # scores: [Hkv, L] -> [Hkv, budget] slot indices
    """
    Hkv = scores.shape[0]
    dev = scores.device
    sink_idx = torch.arange(sinks, device=dev).expand(Hkv, -1)
    top = torch.topk(scores[:, sinks:], budget - sinks, dim=-1, sorted=True).indices + sinks
    out = torch.empty((Hkv, budget), dtype=torch.long, device=dev)
    out[:, :sinks], out[:, sinks:] = sink_idx, top
    return out


class PartialKV:
    """Selected slots [Lyr, Hkv, B] into the full cache (indices, not copies); follows the cache as it grows."""

    def __init__(self, mode: str, budget: int, sinks: int):
        if mode not in KV_MODES:
            raise ValueError(f"kv mode {mode!r} must be one of {', '.join(KV_MODES)}")
        if not 0 <= sinks < budget:
            raise ValueError(f"kv_sinks={sinks} must be >= 0 and below kv_budget={budget}")
        self.mode, self.budget, self.sinks = mode, budget, sinks
        self.reset()

    def reset(self) -> None:
        self.slots: torch.Tensor | None = None  # [Lyr, Hkv, B]
        self.known = 0  # cache slots already reflected in the selection
        self.tail = 0  # next entry to overwrite (moves from B-1 down to the sinks)
        self.rebuilds = 0

    def active(self, cache_len: int) -> bool:
        return self.mode != "full" and cache_len > self.budget

    def refresh(self, cache: KVCache | SeqPages, q_last: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Bring the selection up to the committed cache; None means attend to everything.

        q_last() -> [Lyr, Hq, D] queries of the last committed token (asked for only on a rebuild)
        # -> [Lyr, Hkv, B] or None
        """
        L = cache.length
        if not self.active(L):
            return None
        if self.slots is None:
            self._rebuild(cache, q_last)
            return self.slots
        new = L - self.known
        while new > 0:
            room = self.tail - self.sinks + 1  # entries left before the overwrites reach the sinks
            if room <= 0:
                if self.mode == "dynamic":
                    self._rebuild(cache, q_last)
                    return self.slots
                self.tail, room = self.budget - 1, self.budget - self.sinks  # static selection: wrap around
            m = min(new, room)
            fresh = torch.arange(self.known, self.known + m, device=self.slots.device)
            # newest token takes the least important entry, the next newest the one above it, ...
            self.slots[:, :, self.tail - m + 1 : self.tail + 1] = fresh.flip(0)
            self.tail -= m
            self.known += m
            new -= m
        return self.slots

    def _rebuild(self, cache: KVCache | SeqPages, q_last: Callable[[], torch.Tensor]) -> None:
        L = cache.length
        q = q_last()
        keys = [cache.keys_values(i, L)[0] for i in range(cache.n_layers)]  # [Hkv, L, D] views
        layers = [select_top(importance(q[i], k), self.budget, self.sinks) for i, k in enumerate(keys)]
        self.slots = torch.stack(layers)
        self.known, self.tail = L, self.budget - 1
        self.rebuilds += 1
