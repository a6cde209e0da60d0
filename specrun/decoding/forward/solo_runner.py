"""The engine's runner for one sequence at a time: ModelRunner's contiguous cache behind PagedRunner's packed interface.

Lists of one sequence in, the same hidden rows out; the solo path's attention backends, our CPU kernels' attention
and the static step (CUDA graphs) stay its own. Knows nothing of drafting or sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.forward.static_step import StaticStep

if TYPE_CHECKING:
    from specrun.models.loader import LoadedModel


class SoloRunner:
    def __init__(self, lm: LoadedModel, max_rows: int, backend: str = "sdpa"):
        self.runner = ModelRunner(lm, max_rows=max_rows, backend=backend)
        self.lm, self.decoder, self.lm_head = lm, self.runner.decoder, self.runner.lm_head
        self.static: StaticStep | None = None  # verify forwards through fixed-shape buckets (use_static)

    @property
    def cache(self) -> KVCache | None:
        return self.runner.cache

    @property
    def compiled(self) -> bool:
        return self.runner.compiled

    def use_compiled(self, max_rows: int, measured: bool = False) -> None:
        self.runner.use_compiled(max_rows, measured)

    def use_static(self) -> None:
        """Verify forwards (no partial cache, no queries kept) through static_step's buckets from now on."""
        self.static = StaticStep(self.runner)

    def admit(self, n_tokens: int) -> KVCache:
        """The one sequence's cache, emptied, with room for n_tokens (the engine admits one sequence at a time)."""
        self.runner.reset(n_tokens)
        return self.runner.cache

    @property
    def queries(self) -> list[torch.Tensor]:
        """Per layer q [T, Hq, D] of the last forward that captured them (PagedRunner's layout)."""
        return [q.transpose(0, 1) for q in self.runner.queries]

    def forward(self, seqs: list[KVCache], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                tree_masks: list[torch.Tensor], selects: list | None = None,
                capture_queries: bool = False) -> torch.Tensor:
        """PagedRunner.forward for one sequence (seqs == [self.cache]).

        # tokens[0], positions[0]: [T] long, tree_masks[0]: [T, T] bool -> hidden: [T, H]"""
        select = None if selects is None else selects[0]
        if self.static is not None and selects is None and not capture_queries:
            return self.static.forward(tokens[0], positions[0], tree_masks[0])
        return self.runner.forward(tokens[0], positions[0], tree_masks[0], select=select,
                                   capture_queries=capture_queries)

    def prefill(self, kv: KVCache, tokens: torch.Tensor, chunk: int, capture_queries: bool = False) -> None:
        """# tokens: [P] long, committed after kv's (the runner's cache) length"""
        self.runner.prefill(tokens, chunk, capture_queries=capture_queries)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """# hidden: [T, H] -> [T, V]"""
        return self.runner.logits(hidden)
