"""Timing helpers of the bench: when each watched generated length is reached, and a device sync around a timer."""

from __future__ import annotations

import torch


class LengthClock:
    """Records the elapsed time at which each watched generated length is first reached; counts emitted tokens."""

    def __init__(self, lengths: tuple[int, ...]):
        self.pending, self.count, self.at = sorted(lengths), 0, {}

    def add(self, k: int, elapsed: float) -> None:
        self.count += k
        while self.pending and self.count >= self.pending[0]:
            self.at[self.pending.pop(0)] = elapsed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
