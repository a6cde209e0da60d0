"""Lossless speculative decoding: draft -> build trie -> verify -> accept -> commit KV -> update drafters -> emit.

Output equals plain AR decoding of the model for the same prompt, params and seed, whatever the drafters (I1, I2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generator

import torch

from specrun.decoding.drafters.heads import DraftHeads, load_heads
from specrun.decoding.drafters.partial_kv import PartialKV
from specrun.decoding.drafters.protocol import (
    AUTO_DRAFTERS,
    DRAFTER_NAMES,
    NEEDS_DRAFTER,
    NEEDS_HEADS,
    NEEDS_QUANT,
    Drafter,
    NGramDrafter,
    RecyclingDrafter,
)
from specrun.decoding.drafters.quant_draft import MAX_CHAIN, QuantDrafter, quantized, quantized_rows
from specrun.decoding.drafters.recurrent import DraftWeights, RecurrentDrafter
from specrun.decoding.drafters.recurrent_files import builtin_drafter, load_drafter
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.drafters.self_draft import FusedDrafter, SelfDrafter, TreeTemplate
from specrun.decoding.forward.attention import check_backend
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.forward.static_step import StaticStep
from specrun.decoding.stats import GenStats
from specrun.decoding.step import Drafting, accept
from specrun.decoding.verify.sampling import SamplingParams
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import Trie, build_trie
from specrun.decoding.width.shadow import Shadow, shadowable
from specrun.decoding.width.tuner import WidthTuner

if TYPE_CHECKING:
    from specrun.models.loader import LoadedModel

RECYCLING_K = 8


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
    step_graphs: str = "auto"  # width-1 steps by static_step.py: on (CUDA graphs on CUDA, its eager twin elsewhere),
    # off, or auto (on where CUDA graphs run)
    compile_layers: bool = False  # forwards of up to 64 rows through layers compiled by inductor (CPU; compiled.py),
    # compiled when the engine starts

    def __post_init__(self):
        names = self.drafters if self.drafters is not None else ()
        unknown = [d for d in names if d not in DRAFTER_NAMES]
        if unknown:
            raise ValueError(f"unknown drafter {unknown[0]!r}; choose from {', '.join(DRAFTER_NAMES)} or none")
        if len(set(names)) != len(names):
            raise ValueError(f"drafter listed twice in {','.join(names)}")
        for name, value, low in (("trie_budget", self.trie_budget, 1), ("ngram_topk", self.ngram_topk, 0),
                                 ("prefill_chunk", self.prefill_chunk, 1), ("kv_budget", self.kv_budget, 1)):
            if value < low:
                raise ValueError(f"{name}={value} must be >= {low}")
        PartialKV(self.kv_mode, self.kv_budget, self.kv_sinks)  # validates mode, budget and sinks
        check_backend(self.attention)
        if self.step_graphs not in ("auto", "on", "off"):
            raise ValueError(f"step_graphs={self.step_graphs!r}; choose from auto, on, off")
        TreeTemplate(self.tree)  # validates the tree spec

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
                raise ValueError(f"drafter {name!r} runs the model's 4-bit copy: it needs a model on the CPU whose "
                                 f"linear layers take inputs in groups of 32 (a batched worker: one KV page a sequence)")
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
    solo: a solo engine, else a batched one, whose 4-bit self-draft runs where each sequence's K/V is one page
    (whole_pages: the CPU's layout)."""
    heads = heads if heads is not None or not config.heads_path else load_heads(config.heads_path, lm)
    recurrent = config.recurrent_weights(lm)
    dec = FusedDecoder.of(lm.model)
    can_quantize = config.wants_quant and (quantized(dec) is not None and config.attention == "sdpa" if solo
                                     else whole_pages and quantized_rows(dec) is not None)
    return heads, recurrent, config.active_drafters(heads is not None, recurrent is not None, can_quantize)


def make_drafter(name: str, config: EngineConfig, heads: DraftHeads | None, lm_head, recycling: RecyclingMatrix | None,
                 self_drafter: Callable[[PartialKV], Drafter], recurrent: DraftWeights | None = None) -> Drafter:
    """One drafter of config's; self_drafter(partial cache) builds the engine's own kind of self-drafter."""
    if name == "heads":
        return self_drafter(PartialKV(config.kv_mode, config.kv_budget, config.kv_sinks))
    if name == "fused":
        return FusedDrafter(heads, lm_head, config.tree)
    if name == "recurrent":
        return RecurrentDrafter(recurrent)
    return NGramDrafter(config.ngram_topk) if name == "ngram" else RecyclingDrafter(recycling)


@dataclass
class GenerationResult:
    token_ids: list[int]  # every generated token, resumed ones included
    finish_reason: str  # "eos" | "stop" (a stop string or stop token) | "length" | "stopped" (interrupted)
    stats: dict = field(default_factory=dict)


class Engine:
    def __init__(self, lm: LoadedModel, config: EngineConfig = EngineConfig(), heads: DraftHeads | None = None):
        self.lm = lm
        self.config = config
        heads, self.recurrent, names = resolve_drafting(config, lm, heads)
        self.runner = ModelRunner(lm, max_rows=max(config.trie_budget, config.prefill_chunk), backend=config.attention)
        if config.compile_layers:  # plain AR forwards one row a step
            self.runner.use_compiled(config.trie_budget if names else 1)
        self.vocab_size = self.runner.lm_head.weight.shape[0]  # output vocabulary, may exceed the tokenizer's
        self.recycling = RecyclingMatrix(self.vocab_size, k=RECYCLING_K, device=lm.device) if "recycling" in names else None
        self.drafters: list[Drafter] = [
            QuantDrafter(self.runner, quantized(self.runner.decoder, config.compile_layers)) if n == "quant" else
            make_drafter(n, config, heads, self.runner.lm_head, self.recycling,
                         lambda kv: SelfDrafter(self.runner, heads, config.tree, kv), self.recurrent) for n in names]
        self.self_draft = next((d for d in self.drafters if isinstance(d, SelfDrafter)), None)
        ngram = next((d for d in self.drafters if isinstance(d, NGramDrafter)), None)
        for d in self.drafters:
            if isinstance(d, QuantDrafter) and ngram is not None and ngram.topk:
                d.copy = ngram.copy  # where the copy drafts, it leads
        self._capture = self.self_draft is not None and self.self_draft.needs_queries
        # width-1 steps by the static step, but where the self-draft reads each forward's queries
        graphs = config.step_graphs == "on" or (config.step_graphs == "auto" and lm.device.type == "cuda")
        self.static = StaticStep(self.runner) if graphs and not self._capture else None
        self.drafting = Drafting(names)
        # measured online and kept across generations (costs and acceptance carry over to the next prompt); greedy and
        # sampled text apart: the same widths pay differently (greedy text loops, the n-gram copy drafts its steps)
        chain = "quant" in names  # the 4-bit self-draft's chain leads every trie, a forward a token (sampled: it always
        # drafts; greedy: the n-gram copy drafts where it can)
        self._tuners = {greedy: WidthTuner(config.trie_budget, narrow_bounds=not chain,
                                            chain=MAX_CHAIN + 1 if chain and not greedy else 0)
                        for greedy in (False, True)} if self.drafters and config.adaptive_budget else None
        self.tuner: WidthTuner | None = None  # the one of the generation in flight (or the last)
        self._shadowing = self._tuners is not None and shadowable(names)
        self.stats: GenStats | None = None  # counters of the generation in flight (or the last): on_step may read them

    # -- the recipe ---------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        resume_from: list[int] = (),
        on_step: Callable[[list[int]], bool] | None = None,
    ) -> GenerationResult:
        """Run steps() to the end; on_step(emitted) after each step, True stops the generation ("stopped")."""
        steps, stop = self.steps(prompt_ids, params, resume_from), None
        while True:
            try:
                emitted = steps.send(stop)  # send(None) starts it
            except StopIteration as end:
                return end.value
            stop = on_step is not None and bool(on_step(emitted))  # outside the try: its own StopIteration propagates

    def steps(self, prompt_ids: list[int], params: SamplingParams, resume_from: list[int] = ()
              ) -> Generator[list[int], bool, GenerationResult]:
        """The generation one step at a time: yields each step's emitted tokens (the prefill runs before the first);
        send(True) stops it. Returns the GenerationResult. An engine runs one generation at a time (its KV cache and
        stats are its own); separate engines' steps can be interleaved (specrun bench's lockstep)."""
        st = self._start(prompt_ids, params, list(resume_from))
        stats = self.stats = GenStats(tuple(d.name for d in self.drafters))
        self.tuner = self._tuners[params.greedy] if self._tuners else None
        done = st.finished()
        if done:
            return GenerationResult(st.out, done, stats.as_dict())
        with stats.time("prefill"):
            self.runner.prefill(st.seq[: st.n - 1], self.config.prefill_chunk, capture_queries=self._capture)
        shadow = Shadow() if self._shadowing else None
        while not done:
            t_step = time.perf_counter()
            budget = self.tuner.choose() if self.tuner else self.config.trie_budget
            drafts = []
            with stats.time("draft"):
                full = self.config.trie_budget
                shadowing = shadow is not None and budget < full and shadow.due()  # what a full trie would accept
                if budget > 1 or shadowing:  # a width of 1 verifies the root alone: drafting would be wasted
                    drafts = self.drafting.propose(self.drafters, st.draft_context(full if shadowing else budget,
                                                                                 bool(self.drafting.coupled)))
                if shadowing:  # the verified trie below is its first `budget` nodes
                    shadow.take(build_trie(st.root, drafts, full, self.lm.device), len(st.out))
            with stats.time("trie"):
                trie = build_trie(st.root, drafts, budget, self.lm.device)
            with stats.time("forward"):
                hidden, logits = self._verify(st, trie)
            nodes, emitted = accept(st, trie, logits, hidden, self.runner.cache, self.drafters, stats,
                                    self.drafting.coupled, width=budget if self.drafters else 1)
            if self.tuner:  # the whole step's cost: drafting and bookkeeping count against a width as the forward does
                self.tuner.observe(budget, nodes, time.perf_counter() - t_step, trie.size)
                if shadow is not None and (shadow_path := shadow.resolve(st.out)) is not None:
                    self.tuner.observe_shadow([shadow_path])
            done = st.finished()
            stop = yield emitted
            if stop and not done:
                done = "stopped"
        if self.self_draft is not None:
            stats.kv_rebuilds = self.self_draft.kv.rebuilds
        return GenerationResult(st.out, done, stats.as_dict())

    # -- steps ----------------------------------------------------------------------------------------------------
    def _start(self, prompt_ids: list[int], params: SamplingParams, resumed: list[int]) -> Sequence:
        st = Sequence(prompt_ids, params, resumed, vocab_size=self.vocab_size, eos_ids=self.lm.eos_ids,
                      tokenizer=self.lm.tokenizer, max_context=self.lm.max_context, spare=self.config.trie_budget,
                      device=self.lm.device)
        self.runner.reset(st.capacity)
        known = st.known
        for d in self.drafters:
            d.start(known)
        return st

    def _verify(self, st: Sequence, trie: Trie) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the trie: root at position n-1, each node at n-1+depth. -> hidden [T, H], logits [T, V]"""
        positions = trie.depths + (st.n - 1)
        if trie.size == 1 and self.static is not None:
            hidden = self.static.forward(trie.tokens, positions)
            return hidden, self.runner.logits(hidden)
        hidden = self.runner.forward(trie.tokens, positions, trie.ancestors, capture_queries=self._capture)
        return hidden, self.runner.logits(hidden)

