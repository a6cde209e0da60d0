"""Lossless speculative decoding, one engine for one sequence or several: per step schedule -> draft -> build tries ->
one verify forward for every active sequence -> accept, commit, update drafters -> emit.

A sequence's tokens equal its solo AR decoding for the same prompt, params and seed, whatever the drafters and whatever
runs beside it (I1, I2); step cost follows rows (I5). generate() and steps() are one sequence: a batch of one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass

import torch

from specrun.decoding.compiles import Compiles
from specrun.decoding.config import BatchConfig, EngineConfig, GenerationResult, build_drafters, resolve_drafting
from specrun.decoding.drafters import quant_draft as qd
from specrun.decoding.drafters.heads import DraftHeads
from specrun.decoding.drafters.protocol import Drafter
from specrun.decoding.drafters.quant_draft import KVView, QuantDrafter
from specrun.decoding.drafters.recycling import RecyclingMatrix
from specrun.decoding.drafters.self_draft import SelfDrafter, draft_batch
from specrun.decoding.forward.paged_runner import PagedRunner
from specrun.decoding.forward.solo_runner import SoloRunner
from specrun.decoding.stats import GenStats
from specrun.decoding.step import Drafting, accept, draft, new_sequence, width_tuner
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.sequence import Sequence, choose_together
from specrun.decoding.verify.trie import Trie, build_trie
from specrun.decoding.width.shadow import Shadow, shadowable
from specrun.decoding.width.tuner import WidthTuner

__all__ = ["BatchConfig", "Engine", "EngineConfig", "GenerationResult"]
RECYCLING_K = 8  # next-token candidates the recycling matrix keeps per token


@dataclass
class _Active:
    """One admitted sequence: its tokens and stop rules, K/V, own drafters and statistics."""

    key: object
    st: Sequence
    kv: object  # its K/V: the solo runner's KVCache or its SeqPages (both commit(path), page_view(), release())
    drafters: list[Drafter]
    stats: GenStats
    heads: SelfDrafter | None = None  # its self-drafter, which the step's draft forward feeds
    quant: QuantDrafter | None = None  # its 4-bit self-drafter, fed by the step's 4-bit forwards
    trie: Trie | None = None  # this step's
    shadow: Shadow | None = None  # its full-width trie drafted at a narrower step, for the tuner
    done: str | None = None  # finish reason once finished (or "stopped" by the caller)


class Engine:
    def __init__(self, lm, config: EngineConfig = EngineConfig(), batch: BatchConfig = BatchConfig(), *,
                 heads: DraftHeads | None = None):
        self.solo = solo = batch.concurrency == 1
        heads, self.recurrent, names = resolve_drafting(config, lm, heads, solo, batch.page_tokens(lm.device.type) > 1)
        self.lm, self.config, self.batch, self.heads, self.names = lm, config, batch, heads, names
        self.runner = SoloRunner(lm, max(config.trie_budget, config.prefill_chunk), config.attention) if solo \
            else PagedRunner(lm, batch.kv_tokens, batch.page_tokens(lm.device.type), batch.backend)
        self.compiles = Compiles(config, self.runner, (config.trie_budget if names else 1) * batch.concurrency, solo)
        # the self-drafters' partial caches rank slots by the last committed token's queries: verify keeps them
        self._capture = "heads" in names and config.kv_mode != "full"
        graphs = config.step_graphs == "on" or (config.step_graphs == "auto" and lm.device.type == "cuda")
        if solo and graphs and not self._capture:
            self.runner.use_static()
        self.vocab_size = self.runner.lm_head.weight.shape[0]  # output vocabulary, may exceed the tokenizer's
        # the worker's one matrix: every sequence's verify teaches it, every sequence drafts from it
        self.recycling = RecyclingMatrix(self.vocab_size, k=RECYCLING_K, device=lm.device) if "recycling" in names else None
        self.drafting = Drafting(names)
        # the 4-bit forward of all drafts
        self.quant = self.compiles.draft(qd.quantized(self.runner.decoder) if "quant" in names else None)
        # per (active sequences, greedy, 4-bit chain), kept across generations: cost follows rows; greedy text pays
        # other widths
        self._tuners: dict[tuple[int, bool, bool], WidthTuner] = {}
        self._shadowing = config.adaptive_budget and shadowable(names)
        self.active: list[_Active] = []
        self.asked = 0  # new tokens its sequences asked for so far (compile_draft auto)
        self.tuner: WidthTuner | None = None  # the last step's
        self.stats: GenStats | None = None  # counters of the generation steps() runs (or ran last): on_step may read
        self.drafters: list[Drafter] | None = None  # and its drafters

    # -- admission --------------------------------------------------------------------------------------------------
    def admit(self, key, prompt_ids: list[int], params: SamplingParams, resume_from: list[int] = ()) -> bool:
        """Start a sequence if a slot and its whole KV need are free (prefill included); False leaves nothing changed."""
        if len(self.active) >= self.batch.concurrency:
            return False
        st = new_sequence(self.lm, prompt_ids, params, list(resume_from), self.vocab_size, self.config.trie_budget)
        kv = self.runner.admit(st.capacity)
        if kv is None:
            return False
        self.prepare(params, len(resume_from))
        self.asked += params.max_tokens - len(resume_from)
        drafters = build_drafters(self.names, self.config, self.heads, self.runner.lm_head, self.recycling,
                                  self.recurrent, lambda p: SelfDrafter(self.heads, self.config.tree, p),
                                  lambda: QuantDrafter(self.quant, kv))
        known = st.known
        for d in drafters:
            d.start(known)
        a = _Active(key, st, kv, drafters, GenStats(tuple(self.names)),
                    next((d for d in drafters if isinstance(d, SelfDrafter)), None),
                    next((d for d in drafters if isinstance(d, QuantDrafter)), None),
                    shadow=Shadow() if self._shadowing else None)
        if not st.finished():
            with a.stats.time("prefill"):
                self.runner.prefill(kv, st.seq[: st.n - 1], self.config.prefill_chunk, capture_queries=self._capture)
            if a.heads is not None and st.n > 1:
                a.heads.see_queries(self.runner.queries, -1)  # the prompt's last token
        self.active.append(a)
        return True

    def prepare(self, params: SamplingParams, resumed: int = 0) -> None:
        """Compile what the next sequence pays for (compiles.py: the layers, the 4-bit draft's graph where it runs on
        torch's kernels); admit calls it, a caller may call it first to keep the compile apart."""
        self.expect(self.asked + params.max_tokens - resumed)

    def would_build(self, tokens: int) -> list[str]:
        """What expect(tokens) would compile that the cache lacks (Compiles.would_build)."""
        return self.compiles.would_build(tokens, self.quant)

    @property
    def draft_compile_error(self) -> str | None:
        """Why the 4-bit draft's graph did not compile (it then drafts eagerly), or None."""
        return getattr(self.quant, "_specrun_compile_failed", None)

    def expect(self, tokens: int) -> None:
        """Compile (or load) what generations asking `tokens` new tokens in all pay for (a job's worker: at warm(),
        for its share of the job, before any prompt)."""
        quant, self.quant = self.quant, self.compiles.expect(tokens, self.quant)
        if self.quant is not quant:
            for a in self.active:
                if a.quant is not None:
                    a.quant.forward = self.quant

    # -- the recipe, over the batch ---------------------------------------------------------------------------------
    def step(self, on_step: Callable[[object, list[int]], bool] | None = None) -> list[tuple[object, GenerationResult]]:
        """One verify forward for every active sequence; on_step(key, emitted) after each sequence's accept, True stops
        it ("stopped"); returns the sequences that finished (and frees them)."""
        finished = [a for a in self.active if a.st.finished()]  # admitted already complete (resumed to the end)
        live = [a for a in self.active if a not in finished]
        if live:
            t_step = time.perf_counter()
            quant = self.compiles.drafting(self.quant)  # the 4-bit forward drafting this step, or None
            tuner = self.tuner = self._tuner(len(live), all(a.st.params.greedy for a in live), quant is not None)
            budget = tuner.choose() if tuner else self.config.trie_budget  # schedule: the width of every trie
            seconds = self._draft(live, budget, quant)
            t = time.perf_counter()
            hidden, logits = self._verify(live)
            seconds["forward"] = time.perf_counter() - t
            accepted = self._accept(live, budget, hidden, logits, seconds)
            if tuner:  # the whole step's cost (drafting and bookkeeping too) against the width every sequence used
                tuner.observe_batch(budget, [nodes for nodes, _ in accepted], time.perf_counter() - t_step,
                                    sum(a.trie.size for a in live) / len(live))
                shadows = [p for a in live if a.shadow is not None and (p := a.shadow.resolve(a.st.out)) is not None]
                if shadows:
                    tuner.observe_shadow(shadows)
            for a, (_, emitted) in zip(live, accepted):  # emit
                a.done = a.st.finished()
                if on_step is not None and on_step(a.key, emitted) and not a.done:
                    a.done = "stopped"
                if a.done:
                    finished.append(a)
        return [self._retire(a) for a in finished]

    def _draft(self, live: list[_Active], budget: int, quant) -> dict[str, float]:
        """Every sequence's trie of `budget` nodes (of k with k tokens left: all it can take): the forward drafters run
        once for all (the self-draft's one, the 4-bit chains' one a depth), then each one's propose. -> seconds"""
        t = time.perf_counter()
        widths = [min(budget, a.st.left) for a in live]
        drafting = [a for a, w in zip(live, widths) if a.heads is not None and w > 1]
        if drafting:  # one self-draft forward for all: each root over its own partial cache
            draft_batch(self.runner, self.heads, [(a.kv, a.heads, a.st.root, a.st.n - 1) for a in drafting])
        if quant is not None:  # one 4-bit forward a depth for every sequence's chain (none at width 1)
            qd.draft_batch(quant, [e for a, w in zip(live, widths) if (e := self._quant_entry(a, w)) is not None])
        drafts = [draft(self.drafting, a.drafters, a.st, w, self.config.trie_budget if w == budget else w, a.shadow,
                        self.lm.device) for a, w in zip(live, widths)]
        t_trie = time.perf_counter()
        for a, d, w in zip(live, drafts, widths):
            a.trie = build_trie(a.st.root, d, w, self.lm.device)
        return {"draft": t_trie - t, "trie": time.perf_counter() - t_trie}

    def _accept(self, live: list[_Active], budget: int, hidden: torch.Tensor, logits: torch.Tensor,
                seconds: dict[str, float]) -> list[tuple[list[int], list[int]]]:
        """Each sequence's accept on its rows (choose, a kind of settings' rows at once; walk, stops, commit, drafters),
        then the shared recycling matrix learns every row. # hidden: [N, H], logits: [N, V] -> (nodes, emitted) each"""
        accepted, offset = [], 0
        for a, ours in zip(live, choose_together([a.st for a in live], [a.trie for a in live], logits)):
            for phase, sec in seconds.items():  # every sequence waited for the whole step's drafting and forward
                a.stats.phase[phase] += sec  # (before accept records the step: its length bucket counts them)
            rows = slice(offset, offset + a.trie.size)
            if a.heads is not None and self._capture:
                a.heads.see_queries(self.runner.queries, offset)
            offset += a.trie.size
            accepted.append(accept(a.st, a.trie, logits[rows], hidden[rows], a.kv, a.drafters, a.stats,
                                   self.drafting.coupled, budget if self.names else 1, ("recycling",), ours))
        if self.recycling is not None:  # the shared matrix learns every sequence's nodes at once, in their order
            self.recycling.learn_step(torch.cat([a.trie.tokens for a in live]), logits, plain=budget == 1)
        return accepted

    def _retire(self, a: _Active) -> tuple[object, GenerationResult]:
        if a.heads is not None:
            a.stats.kv_rebuilds = a.heads.kv.rebuilds
        self.drop(a.key)
        stats = {**a.stats.as_dict(), "compiled_layers": self.runner.compiled}  # at its end (auto may switch them on)
        return a.key, GenerationResult(a.st.out, a.done or a.st.finished(), stats)

    def stats_of(self, key) -> GenStats:
        return next(a.stats for a in self.active if a.key == key)  # a checkpointer reads them from its on_step

    def drop(self, key) -> None:
        """Forget an active sequence (retired, or its step failed); its K/V go back to the pool."""
        for a in [a for a in self.active if a.key == key]:
            a.kv.release()
            self.active.remove(a)

    def _tuner(self, n: int, greedy: bool, chain: bool) -> WidthTuner | None:
        """The tuner of steps of n sequences, all greedy or not (a mix drafts as sampled text: the chain), the 4-bit
        chain drafting or not (compiles.drafting: a chain tuner explores every wider width, which other drafts lose)."""
        if not self.names or not self.config.adaptive_budget:
            return None
        key = (n, greedy, chain)
        if key not in self._tuners:
            self._tuners[key] = width_tuner(self.config.trie_budget, chain, greedy)
        return self._tuners[key]

    def _quant_entry(self, a: _Active, budget: int) -> tuple[KVView, QuantDrafter, object] | None:
        """What the 4-bit forward needs of a sequence drafting with it this step (one-store K/V, drafter, context)."""
        view = KVView.of(a.kv) if a.quant is not None else None
        ctx = a.st.draft_context(budget, True) if view is not None else None
        return None if ctx is None or not a.quant.wants(ctx) else (view, a.quant, ctx)

    def _verify(self, live: list[_Active]) -> tuple[torch.Tensor, torch.Tensor]:
        """One packed forward: each trie's root at its sequence's position n-1. -> hidden [N, H], logits [N, V]"""
        hidden = self.runner.forward([a.kv for a in live], [a.trie.tokens for a in live],
                                     [a.trie.depths + (a.st.n - 1) for a in live], [a.trie.ancestors for a in live],
                                     capture_queries=self._capture)
        return hidden, self.runner.logits(hidden)

    # -- whole generations ----------------------------------------------------------------------------------------------
    def run(self, requests: Iterable[tuple[object, list[int], SamplingParams, list[int]]],
            on_step: Callable[[object, list[int]], bool] | None = None) -> dict[object, GenerationResult]:
        """Keep up to `concurrency` sequences in flight, in the order given (callers put the longest first); a call
        that raises (a step, on_step, an interrupt) drops the sequences it admitted: the engine is free again."""
        pending, self.drafters = list(requests), None  # steps()'s last sequence's drafters go
        keys, results = [r[0] for r in pending], {}
        try:
            while pending or self.active:
                while pending and self.admit(*pending[0]):
                    pending.pop(0)
                if pending and not self.active:
                    raise self.too_big(f"request {pending[0][0]!r}", *pending[0][1:3])
                results.update(self.step(on_step))
        except BaseException:
            for key in keys:
                self.drop(key)
            raise
        return results

    def generate(self, prompt_ids: list[int], params: SamplingParams, resume_from: list[int] = (),
                 on_step: Callable[[list[int]], bool] | None = None) -> GenerationResult:
        """One sequence to its end; on_step(emitted) after each step, True stops it ("stopped")."""
        steps, stop = self.steps(prompt_ids, params, resume_from), None
        while True:
            try:
                emitted = steps.send(stop)  # send(None) starts it
            except StopIteration as end:
                return end.value
            stop = on_step is not None and bool(on_step(emitted))  # outside the try: its own StopIteration propagates

    def steps(self, prompt_ids: list[int], params: SamplingParams, resume_from: list[int] = ()
              ) -> Generator[list[int], bool, GenerationResult]:
        """One sequence a step at a time, on an engine with none in flight: yields each step's emitted tokens (the
        prefill runs before the first); send(True) stops it. Returns its GenerationResult. Separate engines' steps can
        be interleaved (specrun bench's lockstep)."""
        if self.active:
            raise RuntimeError("steps() runs one sequence on an engine with none in flight")
        key, self.drafters = object(), None  # the last one's drafters go (a draft forward keeps state per drafter)
        if not self.admit(key, prompt_ids, params, resume_from):
            raise self.too_big("the prompt", prompt_ids, params)
        self.stats, self.drafters = self.active[-1].stats, self.active[-1].drafters
        emitted: list[int] = []
        try:
            while True:
                emitted.clear()
                done = self.step(lambda _, e: emitted.extend(e))
                if done:
                    if emitted:
                        yield list(emitted)
                    return done[0][1]
                if (yield list(emitted)):
                    self.active[0].done = "stopped"
                    return self._retire(self.active[0])[1]
        finally:  # a step or the caller failed, or the caller dropped the generator: the engine is free again
            self.drop(key)

    def too_big(self, who: str, prompt: list[int], params: SamplingParams) -> ValueError:
        """The error for a request (`who`) whose prompt and new tokens the KV pool cannot hold even alone."""
        return ValueError(f"{who} needs more KV slots ({len(prompt)} + {params.max_tokens} tokens) than the pool holds "
                          f"({self.batch.kv_tokens}): raise kv_tokens")
