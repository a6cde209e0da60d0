"""The partial KV that the 4-bit draft on our kernels attends: a sequence's first SINKS committed slots and at least its
last WINDOW, copied into a mirror (bf16 K/V and their int8 codes) that the draft's own tokens follow.

A drafted token then reads at most SINKS + WINDOW + SLIDE keys however long the text (I5), and the draft never writes
into the target's cache. What it attends only changes how often its tokens are accepted, never the output (I1).
"""

from __future__ import annotations

import torch

# the torch draft's partial KV (its first SINKS slots, at least its last WINDOW): a draft reads 4,080-4,336 keys past
# 4,352 committed slots. A 1,984-slot window drafted as well on smollm2 at its own context, but under yarn:5 it kept
# 3.1-4.0 tokens a width-6 step at 4-6K against 4.9 over the whole cache (4,016: 3.9-4.4; docs/benchmarks.md)
from specrun.decoding.drafters.quant_torch import SINKS, WINDOW
from specrun.decoding.forward.kv_codes import KVCodes
from specrun.decoding.kernels.cpu_kernels import CpuKernels

SLIDE = 256  # the window's first slot moves this far at once: the mirror is copied again every SLIDE tokens
RESERVE = 16  # mirror slots past the committed ones for a draft's own tokens (quant_draft.MAX_CHAIN + 1)


def window_slots(capacity: int, sinks: int = SINKS, window: int = WINDOW, slide: int = SLIDE,
                 reserve: int = RESERVE) -> int:
    """The mirror's slots for a sequence whose cache holds `capacity` slots: no more than it can ever mirror."""
    return -(-min(sinks + window + slide, capacity) // 16) * 16 + -(-reserve // 16) * 16


def window_bytes(layers: int, kv_heads: int, head_dim: int, capacity: int) -> int:
    """Memory of one sequence's mirror: bf16 K and V and their int8 codes (q8_bytes), for every slot."""
    return layers * kv_heads * window_slots(capacity) * (4 * head_dim + 2 * head_dim + 12)


class DraftWindow:
    """One sequence's mirror: slots [0, sinks) are its committed slots [0, sinks), slots [sinks, length) its committed
    slots [first, first + length - sinks). sync() adds the slots committed since its last call; once the mirror could
    not hold them and a draft's reserve, `first` moves to keep the last `window` and the window is copied again."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, sinks: int = SINKS,
                 window: int = WINDOW, slide: int = SLIDE, reserve: int = RESERVE):
        """capacity: the slots of the caches it mirrors (a shorter cache needs a smaller mirror)."""
        self.capacity = capacity
        self.codes = KVCodes(layers, kv_heads, window_slots(capacity, sinks, window, slide, reserve), head_dim)
        self.cap = self.codes.cap  # whole tiles of 16 slots
        shape = (layers, kv_heads, self.cap, head_dim)
        self.k, self.v = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        self.sinks, self.window, self.reserve = sinks, window, reserve
        self.reset()

    def reset(self) -> None:
        """A new sequence: its cache is mirrored again from slot 0."""
        self.first = self.sinks  # the committed slot at mirror slot `sinks` (all slots at their own place until then)
        self.upto = 0  # committed slots [0, upto) are mirrored
        self.length = 0  # mirror slots holding committed K/V: a draft's first token goes to this one
        self.codes.upto = 0

    def sync(self, kernels: CpuKernels, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Mirror the committed slots [0, length) of the bf16 cache k, v (length below the last call's: a new sequence).

        # k, v: [Lyr, Hkv, cap, D] bf16, the target's cache
        """
        if length < self.upto:
            self.reset()
        s = self.sinks
        if self.upto < s:
            n = min(length, s)
            self._copy(k, v, self.upto, n, self.upto)
        if s + length - self.first + self.reserve > self.cap:
            self.first = length - self.window
            lo = self.first
            self.codes.upto = min(self.codes.upto, s)  # every window slot is coded again
        else:
            lo = max(self.upto, self.first)
        if length > lo:
            self._copy(k, v, lo, length, s + lo - self.first)
        self.upto = length
        self.length = min(length, s) + max(0, length - self.first)
        self.codes.sync(kernels, self.k, self.v, self.length)

    def _copy(self, k: torch.Tensor, v: torch.Tensor, lo: int, hi: int, to: int) -> None:
        """Committed slots [lo, hi) to mirror slots [to, to + hi - lo)."""
        self.k[:, :, to : to + hi - lo] = k[:, :, lo:hi]
        self.v[:, :, to : to + hi - lo] = v[:, :, lo:hi]
