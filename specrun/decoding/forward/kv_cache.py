"""Preallocated KV cache, head-major per layer ([Hkv, slots, D]: each head's keys are contiguous rows for attention).

Slots [0, length) hold committed tokens; a forward writes its new K/V right after them; commit keeps the accepted ones.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, capacity: int, n_kv_heads: int, head_dim: int, dtype, device):
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [Lyr, Hkv, S, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # committed slots

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """# k, v: [Hkv, T, D] written at slots [start, start+T)"""
        end = start + k.shape[1]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: need {end} slots, have {self.capacity}")
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v

    def keys_values(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """# -> k, v: [Hkv, end, D] views of slots [0, end)"""
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def gather(self, layer: int, slots: torch.Tensor, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-KV-head selected slots followed by the T fresh slots [start, start+T) (causal among them: T == 1).

        # slots: [Hkv, B] -> k, v: [Hkv, B+T, D]
        """
        Hkv, B = slots.shape
        idx = torch.empty((Hkv, B + T), dtype=torch.long, device=slots.device)
        idx[:, :B] = slots
        idx[:, B:] = torch.arange(start, start + T, device=slots.device)
        heads = torch.arange(Hkv, device=slots.device)[:, None]
        return self.k[layer][heads, idx], self.v[layer][heads, idx]

    def commit(self, offsets: torch.Tensor) -> None:
        """Keep the forward's slots length+offsets (ascending) as the next committed slots; drop the rest.

        # offsets: [A] long, offsets[0] == 0 (the root)
        """
        a = offsets.shape[0]
        src = offsets + self.length
        # index_select copies before the write, so overlapping source/destination is safe
        self.k[:, :, self.length : self.length + a] = self.k.index_select(2, src)
        self.v[:, :, self.length : self.length + a] = self.v.index_select(2, src)
        self.length += a

    def append(self, n: int) -> None:
        """Commit n slots written in order (prefill)."""
        self.length += n

    def page_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer, [Lyr, Hkv, S, D] each: one store holds the whole sequence (SeqPages.page_view's)."""
        return self.k, self.v

    def release(self) -> None:
        """The sequence is done (SeqPages.release's): nothing to give back, the next one's reset empties the cache."""
