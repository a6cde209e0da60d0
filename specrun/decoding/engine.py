"""Lossless speculative decoding: draft -> build trie -> verify -> accept -> commit KV -> update drafters -> emit.

Output equals plain AR decoding of the model for the same prompt, params and seed, whatever the drafters (I1, I2).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Generator

import torch

from specrun.decoding.config import RECYCLING_K, EngineConfig, GenerationResult, build_drafters, resolve_drafting
from specrun.decoding.drafters.heads import DraftHeads
from specrun.decoding.drafters.protocol import Drafter
from specrun.decoding.drafters.quant_draft import QuantDrafter, compiled_draft, draft_cached, quantized
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.drafters.self_draft import SelfDrafter
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.forward.static_step import StaticStep
from specrun.decoding.stats import GenStats
from specrun.decoding.step import Drafting, accept, draft, new_sequence, width_tuner
from specrun.decoding.verify.sampling import SamplingParams
from specrun.decoding.verify.sequence import Sequence
from specrun.decoding.verify.trie import Trie, build_trie
from specrun.decoding.width.shadow import Shadow, shadowable
from specrun.decoding.width.tuner import WidthTuner

if TYPE_CHECKING:
    from specrun.models.loader import LoadedModel

__all__ = ["Engine", "EngineConfig", "GenerationResult"]


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
        self.drafters: list[Drafter] = build_drafters(
            names, config, heads, self.runner.lm_head, self.recycling, self.recurrent,
            lambda kv: SelfDrafter(self.runner, heads, config.tree, kv),
            lambda: QuantDrafter(self.runner, quantized(self.runner.decoder, config.compile_layers)))
        self.self_draft = next((d for d in self.drafters if isinstance(d, SelfDrafter)), None)
        self.quant = next((d for d in self.drafters if isinstance(d, QuantDrafter)), None)
        self.asked = 0  # new tokens its generations asked for so far (compile_draft auto)
        self._capture = self.self_draft is not None and self.self_draft.needs_queries
        # verify forwards by the static step (up to its largest row bucket), but where the self-draft reads queries
        graphs = config.step_graphs == "on" or (config.step_graphs == "auto" and lm.device.type == "cuda")
        self.static = StaticStep(self.runner) if graphs and not self._capture else None
        self.drafting = Drafting(names)
        # measured online and kept across generations (costs and acceptance carry over to the next prompt); greedy and
        # sampled text apart: the same widths pay differently (greedy text loops, the n-gram copy drafts its steps)
        self._tuners = {greedy: width_tuner(config.trie_budget, "quant" in names, greedy)
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
            with stats.time("draft"):
                drafts = draft(self.drafting, self.drafters, st, budget, self.config.trie_budget, shadow, self.lm.device)
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

    def prepare(self, params: SamplingParams, resumed: int = 0) -> None:
        """Compile what the next generation pays for (EngineConfig.compile_draft: the 4-bit draft's graph, where it
        runs on torch's kernels); steps() calls it, a caller may call it first to keep the compile apart."""
        if self.quant is not None and self.config.draft_compiles(self.asked + params.max_tokens - resumed,
                                                                   lambda: draft_cached(self.quant.forward)):
            self.quant.forward = compiled_draft(self.quant.forward)

    # -- steps ----------------------------------------------------------------------------------------------------
    def _start(self, prompt_ids: list[int], params: SamplingParams, resumed: list[int]) -> Sequence:
        st = new_sequence(self.lm, prompt_ids, params, resumed, self.vocab_size, self.config.trie_budget)
        self.prepare(params, len(resumed))  # a request new_sequence refused compiles nothing
        self.asked += params.max_tokens - len(resumed)
        self.runner.reset(st.capacity)
        known = st.known
        for d in self.drafters:
            d.start(known)
        return st

    def _verify(self, st: Sequence, trie: Trie) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the trie: root at position n-1, each node at n-1+depth. -> hidden [T, H], logits [T, V]"""
        positions = trie.depths + (st.n - 1)
        if self.static is not None:
            hidden = self.static.forward(trie.tokens, positions, trie.ancestors)
            return hidden, self.runner.logits(hidden)
        hidden = self.runner.forward(trie.tokens, positions, trie.ancestors, capture_queries=self._capture)
        return hidden, self.runner.logits(hidden)

