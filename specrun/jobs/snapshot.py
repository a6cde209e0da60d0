"""The counts a run shows, as the driver sends them to its view (progress.py, rich_view.py) at most every REFRESH_S.

Snapshot(total_prompts, done_prompts, tokens, total_tokens, running) is plain data; tokens_per_s sums the running ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    total_prompts: int
    done_prompts: int
    tokens: int  # generated so far: the finished prompts' tokens plus the running prompts' live counts
    total_tokens: int  # tokens + the most still to come (max_tokens of the prompts not done)
    running: dict[str, dict]  # prompt id -> its live file (tokens, max_tokens, tokens_per_s, mean_accepted, ...)

    @property
    def tokens_per_s(self) -> float:
        return sum(i.get("tokens_per_s") or 0.0 for i in self.running.values())
