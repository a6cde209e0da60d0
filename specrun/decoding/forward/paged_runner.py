"""Model runner over the paged pool: one forward for the new tokens of many sequences, packed, each at its positions.

Owns the pool and the attention backend; knows nothing of drafting or sampling (the batched twin of runner.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specrun.decoding.forward.paged_attention import BatchContext, FlashInferAttention, resolve_backend
from specrun.decoding.forward.paged_kv import PagePool, SeqPages
from specrun.decoding.forward.plan import build_plan
from specrun.decoding.forward.runner import DecoderRunner

if TYPE_CHECKING:
    from specrun.models.loader import LoadedModel


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """K and V of every layer for one token."""
    n_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * n_kv * head_dim * torch.finfo(dtype).bits // 8


class PagedRunner(DecoderRunner):
    def __init__(self, lm: LoadedModel, kv_tokens: int, page_size: int = 1, backend: str = "auto"):
        super().__init__(lm)
        self.backend = backend = resolve_backend(backend, lm.dtype, lm.device, self.decoder.head_dim)
        dec = self.decoder
        self.pool = PagePool(len(dec.layers), -(-kv_tokens // page_size), page_size, dec.n_kv, dec.head_dim,
                             lm.dtype, lm.device)
        self._flashinfer = FlashInferAttention(lm.device) if backend == "flashinfer" else None

    def admit(self, n_tokens: int) -> SeqPages | None:
        """A sequence's page table that can always grow to n_tokens, or None when the pool cannot promise them."""
        return self.pool.admit(n_tokens)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqPages], tokens: list[torch.Tensor], positions: list[torch.Tensor],
                tree_masks: list[torch.Tensor], selects: list | None = None,
                capture_queries: bool = False) -> torch.Tensor:
        """New tokens of each sequence after its committed ones (their K/V land in its pages; commit keeps some).

        With `selects` (one token per sequence) each sees only its partial cache's slots and itself, or all where its
        entry is None. With capture_queries, self.queries holds each layer's q [sum T_i, Hq, D] afterwards.
        # tokens[i], positions[i]: [T_i] long, tree_masks[i]: [T_i, T_i] bool -> hidden: [sum T_i, H]
        """
        drafting = selects is not None
        plan = build_plan(seqs, tree_masks, pack_mask=self.backend in ("paged", "flashinfer") and not drafting)
        if self._flashinfer is not None and not drafting:
            dec = self.decoder
            self._flashinfer.plan(plan, dec.n_q, dec.n_kv, dec.head_dim, self.lm.dtype, dec.layers[0].scaling)
        queries = [] if capture_queries else None
        ctx = BatchContext(self.pool, plan, self.backend, self._flashinfer, selects=selects, queries=queries)
        hidden = self.decoder(torch.cat(tokens), torch.cat(positions), ctx, self.compiled)
        if capture_queries:
            self.queries = queries
        return hidden

    def prefill(self, sp: SeqPages, tokens: torch.Tensor, chunk: int, capture_queries: bool = False) -> None:
        """Commit K/V for tokens at positions [length, length+P) in causal chunks (queries kept for the last).

        # tokens: [P] long"""
        for s in range(0, tokens.shape[0], chunk):
            part = tokens[s : s + chunk]
            T = part.shape[0]
            pos = torch.arange(sp.length, sp.length + T, device=tokens.device)
            causal = torch.ones((T, T), dtype=torch.bool, device=tokens.device).tril_()
            self.forward([sp], [part], [pos], [causal], capture_queries=capture_queries)
            sp.append(T)
