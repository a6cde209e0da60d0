"""The partial KV that the 4-bit draft on our kernels attends: a sequence's first SINKS committed slots, the older slots
its last query scores highest and its recent ones, WINDOW in all, copied into a mirror that its drafted tokens follow.

A drafted token then reads at most SINKS + WINDOW + SLIDE keys however long the text (I5), and the draft never writes
into the target's cache. What it attends only changes how often its tokens are accepted, never the output (I1).
"""

from __future__ import annotations

import torch

from specrun.decoding.drafters.partial_kv import importance

# the torch draft's SINKS and WINDOW: a draft reads 4,080-4,336 keys past 4,352 committed slots. Under yarn:5 the
# target reads far back: the recent 4,016 slots alone lost ~1 token a width-6 step past the first rebuild; with half
# of them chosen by importance it lost ~0.4, with 1,984 slots ~1.7 (docs/benchmarks.md, stop 52)
from specrun.decoding.drafters.quant_torch import SINKS, WINDOW
from specrun.decoding.forward.kv_codes import KVCodes
from specrun.decoding.kernels.cpu_kernels import CpuKernels

SLIDE = 256  # a rebuild leaves this much room: the mirror is chosen and copied again every SLIDE tokens
RESERVE = 16  # mirror slots past the committed ones for a draft's own tokens (quant_draft.MAX_CHAIN + 1)
RECENT_SHARE = 0.5  # of the window, the share of the last slots kept whatever their importance
SCORED_SPAN = 4096  # a rebuild scores whole spans of slots: oneDNN keeps a primitive for every shape it multiplies


def window_slots(capacity: int, sinks: int = SINKS, window: int = WINDOW, slide: int = SLIDE,
                 reserve: int = RESERVE) -> int:
    """The mirror's slots for a sequence whose cache holds `capacity` slots: no more than it can ever mirror."""
    return -(-min(sinks + window + slide, capacity) // 16) * 16 + -(-reserve // 16) * 16


def window_bytes(layers: int, kv_heads: int, head_dim: int, capacity: int) -> int:
    """Memory of one sequence's mirror: bf16 K and V and their int8 codes (q8_bytes), for every slot."""
    return layers * kv_heads * window_slots(capacity) * (4 * head_dim + 2 * head_dim + 12)


class DraftWindow:
    """One sequence's mirror. Until it first fills, mirror slot i is committed slot i. Once a sync's slots and a draft's
    reserve would not fit, it is rebuilt: per layer and KV head the sinks, the `window - recent` older slots that the
    draft's last query (note_query) scores highest (q . k, TokenSwift's importance), and the last `recent` slots; the
    slots committed after a rebuild follow it in order. `held()` says which committed slot each mirror slot holds."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, sinks: int = SINKS,
                 window: int = WINDOW, slide: int = SLIDE, reserve: int = RESERVE, recent: int | None = None):
        """capacity: the slots of the caches it mirrors (a shorter cache needs a smaller mirror); recent: of the
        window, the last slots kept (default RECENT_SHARE of it)."""
        recent = max(1, int(window * RECENT_SHARE)) if recent is None else recent
        if not 0 < recent <= window:
            raise ValueError(f"recent={recent} must be in (0, window={window}]")
        self.capacity = capacity
        self.codes = KVCodes(layers, kv_heads, window_slots(capacity, sinks, window, slide, reserve), head_dim)
        self.cap = self.codes.cap  # whole tiles of 16 slots
        shape = (layers, kv_heads, self.cap, head_dim)
        self.k, self.v = torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16)
        self.sinks, self.window, self.reserve, self.recent = sinks, window, reserve, recent
        self.query: torch.Tensor | None = None  # [Lyr, Hq, D]: the draft's last root query
        self.reset()

    def reset(self) -> None:
        """A new sequence: its cache is mirrored again from slot 0."""
        self.selected: torch.Tensor | None = None  # [Lyr, Hkv, n] long: the committed slots at mirror slots [0, n)
        self.base = 0  # mirror slots [n, length) hold committed slots [base, upto), n = length - (upto - base)
        self.upto = 0  # committed slots [0, upto) are mirrored (or were left out by a rebuild)
        self.length = 0  # mirror slots holding committed K/V: a draft's first token goes to this one
        self.rebuilds = 0
        self.query = None
        self.codes.upto = 0

    def note_query(self, q: torch.Tensor) -> None:
        """The draft's rotated queries at its root token: the next rebuild scores the older slots against them.

        # q: [Lyr, Hq, D]
        """
        self.query = q

    def held(self) -> torch.Tensor:
        """# -> [Lyr, Hkv, length] long: the committed slot each mirror slot holds"""
        Lyr, Hkv = self.k.shape[:2]
        tail = torch.arange(self.base, self.upto).expand(Lyr, Hkv, -1)
        return tail if self.selected is None else torch.cat([self.selected, tail], dim=2)

    def sync(self, kernels: CpuKernels, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """Mirror the committed slots [0, length) of the bf16 cache k, v (length below the last call's: a new sequence).

        # k, v: [Lyr, Hkv, cap, D] bf16, the target's cache
        """
        if length < self.upto:
            self.reset()
        new = length - self.upto
        if self.length + new + self.reserve > self.cap:
            self._rebuild(k, v, length)
        elif new > 0:
            n = self.length
            self.k[:, :, n : n + new] = k[:, :, self.upto : length]
            self.v[:, :, n : n + new] = v[:, :, self.upto : length]
            self.length, self.upto = n + new, length
        self.codes.sync(kernels, self.k, self.v, self.length)

    def _rebuild(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
        """The sinks, the most important of the older slots and the recent ones, per layer and KV head."""
        s, keep, recent = self.sinks, self.window, self.recent
        Lyr, Hkv, _, D = k.shape
        old = length - recent  # slots [s, old) compete on importance
        if self.query is None or keep == recent:  # no query yet: the most recent instead
            chosen = torch.arange(length - keep, old).expand(Lyr, Hkv, -1)
        else:
            span = min(-(-(old - s) // SCORED_SPAN) * SCORED_SPAN, k.shape[2] - s)  # slots past old: scored, unused
            scores = torch.stack([importance(self.query[i], k[i, :, s : s + span]) for i in range(Lyr)])[..., : old - s]
            chosen = scores.topk(keep - recent, dim=2, sorted=False).indices.sort(dim=2).values + s
        sinks, tail = torch.arange(s).expand(Lyr, Hkv, -1), torch.arange(old, length).expand(Lyr, Hkv, -1)
        self.selected = torch.cat([sinks, chosen, tail], dim=2)
        n = self.selected.shape[2]
        for i in range(Lyr):  # whole rows of D a slot (torch.gather copies element by element: docs/benchmarks.md)
            rows = (torch.arange(Hkv)[:, None] * k.shape[2] + self.selected[i]).view(-1)  # [Hkv * n]
            self.k[i, :, :n] = k[i].reshape(-1, D).index_select(0, rows).view(Hkv, n, D)
            self.v[i, :, :n] = v[i].reshape(-1, D).index_select(0, rows).view(Hkv, n, D)
        self.length, self.base = n, length
        self.upto = length
        self.rebuilds += 1
        self.codes.upto = min(self.codes.upto, s)  # every slot past the sinks is coded again
