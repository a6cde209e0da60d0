"""What an engine is built from: EngineConfig (drafting, width, attention; fixed per job like the model), the drafters
it resolves to for a model, each sequence's drafters, and the GenerationResult every engine returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from specrun.decoding.choices import DRAFTER_NAMES
from specrun.decoding.drafters.heads import DraftHeads, load_heads
from specrun.decoding.drafters.partial_kv import PartialKV
from specrun.decoding.drafters.protocol import (
    AUTO_DRAFTERS,
    NEEDS_DRAFTER,
    NEEDS_HEADS,
    NEEDS_QUANT,
    Drafter,
    NGramDrafter,
    RecyclingDrafter,
)
from specrun.decoding.drafters.quant_draft import quantized
from specrun.decoding.drafters.recurrent import DraftWeights, RecurrentDrafter
from specrun.decoding.drafters.recurrent_files import builtin_drafter, load_drafter
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.drafters.self_draft import FusedDrafter, TreeTemplate
from specrun.decoding.forward.attention import check_backend
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.paged_attention import check_paged_backend
from specrun.errors import ConfigError, is_whole

MAX_TRIE_BUDGET = 1024  # most nodes a verify forward may carry (its rows' buffers are sized by it)
MAX_TREE_NODES = 4096  # most nodes a self-draft tree template may hold
CUDA_PAGE_SIZE = 16  # KV page of an engine of several sequences on GPUs (flashinfer's paged kernels)

# compile_draft auto: an engine compiles the draft's graph once its generations ask for this many new tokens in all, where
# the first compile on a machine (~1-3 minutes) pays (docs/benchmarks.md); a cached one loads at once
COMPILE_DRAFT_TOKENS = 4096
# compile_layers auto: the same for the compiled layers, whose first build (two packages) pays on AR from about here
# (docs/benchmarks.md, stop 66)
COMPILE_LAYERS_TOKENS = 16384


def tree_nodes(tree: tuple[int, ...]) -> int:
    """Nodes of a self-draft tree spec, its root included: 1 + k0 + k0 k1 + ..."""
    nodes, level = 1, 1
    for k in tree:
        level *= max(k, 1)
        nodes += level
    return nodes


@dataclass(frozen=True)
class EngineConfig:
    drafters: tuple[str, ...] | None = None  # None = auto (AUTO_DRAFTERS that can run); () = plain AR
    trie_budget: int = 64  # most nodes per verify; with adaptive_budget the engine picks the best width up to it
    adaptive_budget: bool = True
    ngram_topk: int = 20
    prefill_chunk: int = 256
    heads_path: str | None = None  # trained draft heads (specrun train-heads); enables the "heads" drafter
    drafter_path: str | None = "auto"  # recurrent drafter dir (specrun train-drafter); auto = the one shipped for the
    # model if any; None = none
    tree: tuple[int, ...] = (1, 3, 3, 3)  # self-draft candidates: top-k of l_0, l_1, l_2, l_3 (Cartesian)
    kv_mode: str = "dynamic"  # cache the self-draft forward reads: full | partial | dynamic
    kv_budget: int = 4096
    kv_sinks: int = 16
    attention: str = "sdpa"  # attention backend (decoding/forward/attention.py BACKENDS); fixed per job like the model
    step_graphs: str = "auto"  # verify forwards of up to 64 rows by static_step.py: on (CUDA graphs on CUDA, its
    # eager twin elsewhere), off, or auto (on where CUDA graphs run)
    compile_layers: str = "auto"  # forwards of up to 64 rows through layers compiled by inductor (CPU; compiled.py):
    # on (when the engine starts; the 4-bit self-draft's graph with them), off, or auto (float32 and bfloat16 where our
    # kernels do not run the layers: at once where cached, else once an engine's generations ask for
    # COMPILE_LAYERS_TOKENS; in bfloat16 each package serves only the row counts it ran faster at on loading)
    compile_draft: str = "auto"  # the 4-bit self-draft on torch's kernels as one compiled graph (quant_ring.py): on,
    # off, or auto (at once where its packages are cached, else once an engine's generations ask for
    # COMPILE_DRAFT_TOKENS new tokens in all; an engine of several sequences drafts with it only compiled: compiles.py)

    def __post_init__(self):
        try:
            self._check()
        except (TypeError, ValueError) as e:  # a caller's bad value: a ConfigError (a ValueError) naming it
            raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from None

    def _check(self):
        if isinstance(self.compile_layers, bool):  # a manifest written before auto: True was --compile
            object.__setattr__(self, "compile_layers", "on" if self.compile_layers else "off")
        if isinstance(self.drafters, str) or not (self.drafters is None or isinstance(self.drafters, (tuple, list))):
            raise ValueError(f"drafters={self.drafters!r} must be a tuple of drafter names (None: auto, (): none)")
        for name in ("drafters", "tree"):  # lists as a caller (or JSON) may give them
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        names = self.drafters if self.drafters is not None else ()
        unknown = [d for d in names if d not in DRAFTER_NAMES]
        if unknown:
            raise ValueError(f"unknown drafter {unknown[0]!r}; choose from {', '.join(DRAFTER_NAMES)} or none")
        if len(set(names)) != len(names):
            raise ValueError(f"drafter listed twice in {','.join(names)}")
        for name, value, low in (("trie_budget", self.trie_budget, 1), ("ngram_topk", self.ngram_topk, 0),
                                 ("prefill_chunk", self.prefill_chunk, 1), ("kv_budget", self.kv_budget, 1),
                                 ("kv_sinks", self.kv_sinks, 0)):
            if not is_whole(value):
                raise ValueError(f"{name}={value!r} must be an integer")
            object.__setattr__(self, name, int(value))
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        if self.trie_budget > MAX_TRIE_BUDGET:
            raise ValueError(f"trie_budget={self.trie_budget} must be <= {MAX_TRIE_BUDGET} (nodes one verify forward "
                             f"carries; the widest drafts use under 100)")
        if not isinstance(self.adaptive_budget, bool):
            raise ValueError(f"adaptive_budget={self.adaptive_budget!r} must be True or False")
        if not isinstance(self.tree, tuple) or not all(map(is_whole, self.tree)):
            raise ValueError(f"tree={self.tree!r} must be a tuple of integers, e.g. (1, 3, 3, 3)")
        object.__setattr__(self, "tree", tuple(map(int, self.tree)))
        PartialKV(self.kv_mode, self.kv_budget, self.kv_sinks)  # validates mode, budget and sinks
        check_backend(self.attention)
        for name, value in (("step_graphs", self.step_graphs), ("compile_draft", self.compile_draft),
                            ("compile_layers", self.compile_layers)):
            if value not in ("auto", "on", "off"):
                raise ValueError(f"{name}={value!r}; choose from auto, on, off")
        nodes = tree_nodes(self.tree)  # counted before it is built: (1000, 1000, 1000) would be a billion nodes
        if nodes > MAX_TREE_NODES:
            raise ValueError(f"tree={','.join(map(str, self.tree))} has {nodes:,} nodes; at most {MAX_TREE_NODES:,}")
        TreeTemplate(self.tree)  # validates the tree spec

    def draft_compiles(self, asked: int, cached: Callable[[], bool] = lambda: False) -> bool:
        """Whether an engine whose generations asked for `asked` new tokens in all (the next one's included) drafts
        through the compiled graph, where the 4-bit draft runs on torch's kernels; auto: once they ask for
        COMPILE_DRAFT_TOKENS (its first compile pays there), or at once where cached() (a load of about a second)."""
        return self.compile_layers == "on" or self.compile_draft == "on" or (
            self.compile_draft == "auto" and (asked >= COMPILE_DRAFT_TOKENS or cached()))

    def layers_compile(self, asked: int, eligible: Callable[[], bool], cached: Callable[[], bool]) -> bool:
        """Whether an engine whose generations asked for `asked` new tokens in all runs through the compiled layers:
        on; auto: where eligible() (float32 or bf16 on a CPU whose layers our kernels do not run, a C++ compiler), at
        once where cached() (a load of a second or two), else once they ask for COMPILE_LAYERS_TOKENS."""
        return self.compile_layers == "on" or (self.compile_layers == "auto" and eligible()
                                               and (asked >= COMPILE_LAYERS_TOKENS or cached()))

    @property
    def wants_quant(self) -> bool:
        """A drafter of the model's 4-bit copy is asked for, or may be chosen (auto)."""
        return self.drafters is None or bool(set(NEEDS_QUANT) & set(self.drafters))

    def active_drafters(self, have_heads: bool, have_drafter: bool = False, can_quantize: bool = False
                        ) -> tuple[str, ...]:
        if self.drafters is None:
            return tuple(n for n in AUTO_DRAFTERS if (have_heads or n not in NEEDS_HEADS)
                         and (have_drafter or n not in NEEDS_DRAFTER) and (can_quantize or n not in NEEDS_QUANT))
        for name in self.drafters:
            if name in NEEDS_QUANT and not can_quantize:
                raise ValueError(f"drafter {name!r} runs the model's 4-bit copy: it needs a model whose linear layers "
                                 f"take inputs in groups of 32, on the CPU or a CUDA GPU of compute capability 8.0+, "
                                 f"and each sequence's K/V in one store (a batched worker: one KV page a sequence, "
                                 f"the CPU's layout; one sequence: the sdpa attention backend, --attention sdpa)")
            if name in NEEDS_HEADS and not have_heads:
                raise ValueError(f"drafter {name!r} needs trained draft heads (--heads PATH, see specrun train-heads)")
            if name in NEEDS_DRAFTER and not have_drafter:
                why = "--drafter none was given" if self.drafter_path is None else "none ships for this model"
                raise ValueError(f"drafter {name!r} needs a trained recurrent drafter (--drafter DIR, see specrun "
                                 f"train-drafter); {why}")
        return tuple(n for n in DRAFTER_NAMES if n in self.drafters)  # fixed drafting order

    def recurrent_weights(self, lm) -> DraftWeights | None:
        """The recurrent drafter's weights for lm: drafter_path, or the shipped one for lm (auto), or None."""
        if self.drafter_path is None or (self.drafters is not None and not set(NEEDS_DRAFTER) & set(self.drafters)):
            return None
        path = builtin_drafter(lm) if self.drafter_path == "auto" else self.drafter_path
        if path is None:
            return None
        model = lm.model
        return DraftWeights(load_drafter(path, lm), model.get_input_embeddings(), model.get_output_embeddings())


def resolve_drafting(config: EngineConfig, lm, heads: DraftHeads | None, solo: bool = True, whole_pages: bool = False
                     ) -> tuple[DraftHeads | None, DraftWeights | None, tuple[str, ...]]:
    """(heads, recurrent drafter weights, active drafter names) of config for lm; heads given win over heads_path.
    solo: an engine of one sequence at a time (its contiguous cache), else of several, whose 4-bit self-draft runs
    where each sequence's K/V is one page (whole_pages: the CPU's layout)."""
    heads = heads if heads is not None or not config.heads_path else load_heads(config.heads_path, lm)
    recurrent = config.recurrent_weights(lm)
    dec = FusedDecoder.of(lm.model)
    # auto drafts with the 4-bit copy on the CPU, where it is measured to pay; on CUDA only when asked for (its eager
    # forward there is not measured yet: docs/gpu-check.md), so auto builds no copy of the weights there
    takes_quant = config.drafters is not None or lm.device.type == "cpu"
    can_quantize = config.wants_quant and takes_quant and quantized(dec) is not None and (
        config.attention == "sdpa" if solo else whole_pages and lm.device.type == "cpu")
    return heads, recurrent, config.active_drafters(heads is not None, recurrent is not None, can_quantize)


def build_drafters(names: tuple[str, ...], config: EngineConfig, heads: DraftHeads | None, lm_head,
                   recycling: RecyclingMatrix | None, recurrent: DraftWeights | None,
                   self_drafter: Callable[[PartialKV], Drafter], quant_drafter: Callable[[], Drafter]) -> list[Drafter]:
    """One sequence's drafters, in drafting order; self_drafter(partial cache) and quant_drafter() build the engine's
    own kinds of self-drafter and 4-bit self-drafter. The 4-bit chain gives way to the n-gram copy where that drafts."""
    def make(name: str) -> Drafter:
        if name == "quant":
            return quant_drafter()
        if name == "heads":
            return self_drafter(PartialKV(config.kv_mode, config.kv_budget, config.kv_sinks))
        if name == "fused":
            return FusedDrafter(heads, lm_head, config.tree)
        if name == "recurrent":
            return RecurrentDrafter(recurrent)
        return NGramDrafter(config.ngram_topk) if name == "ngram" else RecyclingDrafter(recycling)

    drafters = [make(n) for n in names]
    quant = next((d for d in drafters if d.name == "quant"), None)
    ngram = next((d for d in drafters if isinstance(d, NGramDrafter)), None)
    if quant is not None and ngram is not None and ngram.topk:
        quant.copy = ngram.copy  # where the copy drafts, it leads
    return drafters


@dataclass(frozen=True)
class BatchConfig:
    """How many sequences a step carries and where their K/V live. One: the runner's contiguous cache, sized at each
    admission (solo_runner.py); several: a paged pool of kv_tokens slots (paged_runner.py)."""

    concurrency: int = 1  # most sequences in one step
    kv_tokens: int = 65536  # KV slots in the pool of several (the memory budget); admission never over-commits it
    page_size: int | None = None  # tokens a KV page; None: by device (page_tokens). P = 1: a commit edits the table
    backend: str = "auto"  # paged_attention.PAGED_BACKENDS, or auto (resolve_backend: by dtype and device)

    def __post_init__(self):
        for name in ("concurrency", "kv_tokens", "page_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        check_paged_backend(self.backend)

    def page_tokens(self, device: str) -> int:
        """page_size, or where None: on the CPU one page a sequence (the pool's share of each), which our kernels'
        attention and the 4-bit draft read in place; on GPUs CUDA_PAGE_SIZE, flashinfer's pages."""
        if self.page_size is not None:
            return self.page_size
        return -(-self.kv_tokens // self.concurrency) if device == "cpu" else CUDA_PAGE_SIZE


@dataclass
class GenerationResult:
    token_ids: list[int]  # every generated token, resumed ones included
    finish_reason: str  # "eos" | "stop" (a stop string or stop token) | "length" | "stopped" (interrupted)
    stats: dict = field(default_factory=dict)
