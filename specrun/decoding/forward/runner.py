"""Model runner: forwards token sets at explicit positions with an explicit mask through our KV cache.

Owns the cache and a preallocated mask buffer; knows nothing of drafting or sampling.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specrun.decoding.forward.attention import ForwardContext
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.kernels.cpu_kernels import CpuKernels, cpu_kernels

SLOT_BLOCK = 256  # cache capacities are multiples of this

if TYPE_CHECKING:
    from specrun.models.loader import LoadedModel


class DecoderRunner:
    """What both runners share (this one and paged_runner's): the model's fused decoder and LM head, the queries of
    the last forward that captured them, and forwards through compiled layers once use_compiled is called."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.decoder = FusedDecoder.of(lm.model)  # refuses architectures and features it would get wrong
        self.lm_head = self.decoder.lm_head
        self.queries: list[torch.Tensor] = []  # per layer: ModelRunner's q [Hq, T, D], PagedRunner's [N, Hq, D]
        self.compiled = False  # forwards through the decoder's compiled layers (use_compiled)

    def use_compiled(self, max_rows: int, measured: bool = False) -> None:
        """Forwards of up to 64 rows through compiled layers (compiled.compile_layers), compiled now; measured: each
        package only for the row counts at which it ran faster than the eager layers (compile_layers auto)."""
        from specrun.decoding.forward.compiled import compile_layers  # inductor loads only where asked for

        compile_layers(self.decoder, max_rows, measured)
        layers = self.decoder.compiled  # None where our kernels run the layers: they stay the path
        self.compiled = layers is not None and layers.runs

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """# hidden: [T, H] -> [T, V] (FusedDecoder.logits; its compiled head where the layers run compiled)"""
        return self.decoder.logits(hidden, self.compiled)


class ModelRunner(DecoderRunner):
    def __init__(self, lm: LoadedModel, max_rows: int, backend: str = "sdpa"):  # backend: checked by EngineConfig
        super().__init__(lm)
        self.backend = backend
        self.model = lm.model
        cfg = self.model.config
        self.n_layers = cfg.num_hidden_layers
        self.n_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_rows = max_rows  # most tokens in one forward (trie budget or prefill chunk)
        self.cache: KVCache | None = None
        self.mask_buf: torch.Tensor | None = None  # [max_rows, capacity] bool, all True outside a forward
        ours = lm.device.type == "cpu" and lm.dtype in (torch.bfloat16, torch.float32) and backend == "sdpa"
        fits = CpuKernels.attends(self.head_dim, cfg.num_attention_heads, self.n_kv_heads)
        self.kernels = cpu_kernels() if ours and fits else None  # attention of the sdpa backend

    def reset(self, capacity: int) -> None:
        """Empty the cache, growing buffers if this generation needs more slots (whole blocks of SLOT_BLOCK: the
        static step's buckets split into equal chunks)."""
        capacity = -(-capacity // SLOT_BLOCK) * SLOT_BLOCK
        if self.cache is None or self.cache.capacity < capacity:
            dev, dt = self.lm.device, self.lm.dtype
            self.cache = KVCache(self.n_layers, capacity, self.n_kv_heads, self.head_dim, dt, dev)
            self.mask_buf = torch.ones((self.max_rows, capacity), dtype=torch.bool, device=dev)
        self.cache.length = 0

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
        capture_queries: bool = False,
    ) -> torch.Tensor:
        """Run T new tokens after the committed slots; their K/V land in slots [length, length+T).

        With `select` ([Lyr, Hkv, B], T == 1) the token sees only those slots (partial cache) and itself.
        With capture_queries, self.queries holds each layer's q [Hq, T, D] afterwards.
        # tokens, positions: [T] long, tree_mask: [T, T] bool (mask among the new tokens) -> hidden: [T, H]
        """
        T = tokens.shape[0]
        start = self.cache.length
        queries = [] if capture_queries else None
        block = None
        if select is None:
            block = self.mask_buf[:T, start : start + T]
            block.copy_(tree_mask)
            ctx = ForwardContext(self.cache, start, self.mask_buf[:T, : start + T], queries=queries, backend=self.backend,
                                 kernels=self.kernels)
        else:
            ctx = ForwardContext(self.cache, start, None, select=select, queries=queries, backend=self.backend)
        try:
            hidden = self.decoder(tokens, positions, ctx, self.compiled)
        finally:
            if block is not None:
                block.fill_(True)  # these slots are prefix (or free) for the next forward
        if capture_queries:
            self.queries = queries
        return hidden

    def prefill(self, tokens: torch.Tensor, chunk: int, capture_queries: bool = False) -> None:
        """Commit K/V for tokens at positions [length, length+P) in causal chunks (queries kept for the last).

        # tokens: [P] long
        """
        P = tokens.shape[0]
        for s in range(0, P, chunk):
            part = tokens[s : s + chunk]
            T = part.shape[0]
            pos = torch.arange(self.cache.length, self.cache.length + T, device=tokens.device)
            causal = torch.ones((T, T), dtype=torch.bool, device=tokens.device).tril_()
            self.forward(part, pos, causal, capture_queries=capture_queries)
            self.cache.append(T)
