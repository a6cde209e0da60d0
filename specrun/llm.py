"""specrun.LLM: a model loaded once in this process; generate(prompts) -> [Output] (several: as many at once as fit),
stream(prompt) -> Deltas as tokens are accepted. Tokens equal `specrun generate`'s (a dict prompt: a job's line's).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from specrun.decoding.engine import EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.errors import ConfigError, ModelError, PromptError, SpecrunError, is_whole

DEMO_NOTICE = "note: --model demo is a tiny RANDOM-WEIGHT model built offline; its text is noise, not language."
MAX_CONCURRENCY = 16  # prompts generated at once by default (actors/memory.py AUTO_MAX: per-step work grows with N)


def load_lm(model: str, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
            rope_scaling: str | None = None):
    """LoadedModel of a local HF directory, 'smollm2' or 'demo' (rope_scaling: 'TYPE:FACTOR', models/rope.py);
    ModelError naming the bad value."""
    from specrun.models.loader import load_model, resolve_dtype

    try:
        return load_model(model, dtype=resolve_dtype(dtype, model, device), device=device,
                          trust_remote_code=trust_remote_code, rope_scaling=rope_scaling)
    except (ValueError, OSError) as e:
        raise ModelError(f"cannot load model {model!r}: {e}") from e


def drafting_config(drafting: EngineConfig | str | None) -> EngineConfig:
    """EngineConfig of `drafting`: one as is, None or 'auto' (the default drafters), 'none' (plain AR) or a comma list
    of drafter names (--draft's values)."""
    if isinstance(drafting, EngineConfig):
        return drafting
    if drafting is not None and not isinstance(drafting, str):
        raise ConfigError(f"drafting must be an EngineConfig, 'auto', 'none' or a comma list of drafters, got "
                          f"{type(drafting).__name__}")
    if drafting is not None and not drafting.strip(" ,"):
        raise ConfigError(f"drafting={drafting!r} names no drafter: 'none' is plain AR, 'auto' the default drafters")
    names = None if drafting in (None, "auto") else tuple(n.strip() for n in drafting.split(",") if n.strip()
                                                          and n.strip() != "none")
    try:
        return EngineConfig(drafters=names)
    except ValueError as e:
        raise ConfigError(str(e)) from e


@dataclass(frozen=True)
class Output:
    """One generation: token_ids (the prompt's not included), text (as returned: without a stop string or token),
    finish_reason (eos, stop, length), stats (what `specrun generate --json` prints); id: a dict prompt's id."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: dict
    prompt_token_ids: list[int]
    id: str | None = None

    def to_json(self) -> dict:
        """The object `specrun generate --json` prints."""
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "stats": self.stats}


@dataclass(frozen=True)
class Delta:
    """What one step accepted: its token ids, and the text they add that is safe to show (complete UTF-8, nothing
    of a stop string); the last Delta may carry held-back text and no tokens."""

    token_ids: list[int]
    text: str


class Stream:
    """Iterator of Deltas of one generation; `output` is its Output once the iteration has ended (else None)."""

    def __init__(self, llm: LLM, ids: list[int], params: SamplingParams, pid: str | None):
        from specrun.models.text_deltas import TextDeltas

        self._llm, self._ids, self._params, self._id = llm, ids, params, pid
        self._steps = llm._solo().steps(ids, params)
        self._text = TextDeltas(llm.tokenizer, params)
        self.output: Output | None = None
        self._closed = False
        llm._reading = weakref.ref(self)  # the one stream of this LLM until it ends, is closed or is dropped

    def __iter__(self) -> Iterator[Delta]:
        return self

    def close(self) -> None:
        """Stop the generation here (`output` stays None): the LLM is free again for generate() and stream()."""
        self._closed = True
        try:
            self._steps.close()
        finally:
            self._release()

    def _release(self) -> None:
        if self._llm._reading is not None and self._llm._reading() is self:
            self._llm._reading = None

    def __next__(self) -> Delta:
        if self.output is not None or self._closed:
            raise StopIteration
        try:
            emitted = self._steps.send(None)  # None: go on (True would stop the generation)
        except StopIteration as end:
            self._release()
            self.output = self._llm._output(self._ids, self._params, end.value, self._id)
            tail = self._text.finish()
            if tail:
                return Delta([], tail)
            raise StopIteration from None
        except BaseException:  # the generation failed (or was interrupted): the LLM is free for the next one
            self._release()
            raise
        return Delta(list(emitted), self._text.push(emitted))


class LLM:
    """A model and its drafting settings, loaded once: LLM('smollm2').generate(['Write a haiku about tea.'])[0].text.

    model: a local HF directory, 'smollm2' or 'demo'; dtype: auto, float32, float64, bfloat16, float16; device: cpu or
    cuda; drafting: an EngineConfig, 'auto', 'none' or a comma list of drafters (the tokens are the same whatever it
    is); chat: a text prompt is sent as one user message through the chat template (auto: where the model has one;
    False: as raw text, as `specrun generate` without --chat); rope_scaling: 'TYPE:FACTOR' extends the context
    (e.g. 'yarn:16'). Raises ModelError when the model cannot be loaded.
    """

    def __init__(self, model: str = "demo", *, dtype: str = "auto", device: str = "cpu",
                 drafting: EngineConfig | str | None = None, trust_remote_code: bool = False,
                 max_concurrency: int = MAX_CONCURRENCY, chat: bool | str = "auto", rope_scaling: str | None = None):
        if not isinstance(model, (str, os.PathLike)):
            raise ModelError(f"model must be a directory path, 'smollm2' or 'demo', got {type(model).__name__}")
        if not is_whole(max_concurrency) or max_concurrency < 1:
            raise ConfigError(f"max_concurrency={max_concurrency!r} must be an integer >= 1")
        max_concurrency = int(max_concurrency)
        if not (isinstance(chat, bool) or chat == "auto"):
            raise ConfigError(f"chat={chat!r} must be True, False or 'auto'")
        self.config = drafting_config(drafting)
        self.lm = load_lm(model, dtype, device, trust_remote_code, rope_scaling)
        # an instruct model answers a request sent as a user message; raw text it may just end (smollm2: EOS at once)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None)) if chat == "auto" else bool(chat)
        self.max_concurrency = max_concurrency
        self._engine = None  # the engine of one prompt at a time, built once: its matrix learns across prompts
        self._batch = None  # the engine of several prompts at once, kept for later calls its slots and pages hold
        self._reading = None  # weakref to the stream being read, if any (one at a time: they share the engine)
        if self.lm.is_demo:
            warnings.warn(DEMO_NOTICE, stacklevel=2)

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    def generate(self, prompts, sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """One Output per prompt, in order. A prompt is text, a list of {role, content} messages (chat template), a
        list of token ids, or a dict as a prompts.jsonl line (id, overrides; its seed derived from the id as a job
        derives it); one prompt alone may be given bare. sampling: one SamplingParams for all or one per prompt
        (default: greedy, 256 tokens). Several prompts run as many at once as the KV memory holds (one engine step for
        all), longest first; the rest in turn. That engine and its KV pool are kept for later calls they hold (its
        recycling matrix learns across calls). PromptError when a prompt is bad (nothing is generated then)."""
        from specrun.actors.memory import concurrency_for, engine_for, kv_need, page_size_for

        reqs = self._requests(prompts, sampling)
        engine = None  # several prompts: an engine of as many at once as the KV memory holds; else the one-prompt one
        if len(reqs) > 1 and self.config.attention == "sdpa" and self.max_concurrency > 1:
            need = kv_need(max(len(ids) + p.max_tokens for ids, p, _ in reqs), self.config.trie_budget)
            device = self.lm.device.type
            wanted, kept = min(len(reqs), self.max_concurrency), self._batch and self._batch.batch
            if kept is None or kept.concurrency < wanted or kept.kv_tokens // kept.concurrency < need:
                self._batch = None  # the kept engine's KV pool goes before the memory is measured for a new one
                n = concurrency_for(self.lm, self.config, wanted, need, device)
                if n > 1:
                    self._batch = engine_for(self.lm, self.config, n, need, page_size_for(device, need))
            engine = self._batch
        order = sorted(range(len(reqs)), key=lambda i: -(len(reqs[i][0]) + reqs[i][1].max_tokens))  # longest first
        results = (engine if engine is not None else self._solo()).run(
            [(i, reqs[i][0], reqs[i][1], []) for i in order])
        return [self._output(ids, p, results[i], pid) for i, (ids, p, pid) in enumerate(reqs)]

    def stream(self, prompt, sampling: SamplingParams | None = None) -> Stream:
        """One prompt's generation as it runs: an iterator of Deltas (token ids as accepted, safe text); the joined
        token ids equal generate()'s, and `stream.output` holds the Output at the end."""
        (ids, params, pid), = self._requests([prompt], sampling)
        return Stream(self, ids, params, pid)

    def encode(self, prompt) -> list[int]:
        """The token ids the model reads for a prompt (text, messages or token ids)."""
        return self._requests([prompt], None)[0][0]

    # -- internals -----------------------------------------------------------------------------------------------
    def _solo(self):
        """The one-sequence engine, for a new generation: refused while a stream holds it (the generation would step
        the stream's sequence too)."""
        reading = self._reading() if self._reading is not None else None
        if (self._engine is not None and self._engine.active) or reading is not None:
            raise SpecrunError("a stream of this LLM is still being read: read it to its end, or close() it, before "
                               "another generate() or stream() on this LLM (or use a second LLM)")
        if self._engine is None:
            from specrun.decoding.engine import Engine

            try:
                self._engine = Engine(self.lm, self.config)
            except ValueError as e:
                raise ConfigError(str(e)) from e
        return self._engine

    def _requests(self, prompts, sampling) -> list[tuple[list[int], SamplingParams, str | None]]:
        from specrun.jobs.inputs import check_unicode
        from specrun.models.prompts import kind_of, user_message

        if isinstance(prompts, (str, dict)) or _one_prompt(prompts):
            prompts = [prompts]
        if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):  # not taken apart
            raise PromptError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
        prompts = list(prompts)
        params = [sampling] * len(prompts) if sampling is None or isinstance(sampling, SamplingParams) \
            else list(sampling) if isinstance(sampling, (list, tuple)) else None
        if params is None or not all(p is None or isinstance(p, SamplingParams) for p in params):
            raise ConfigError(f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}")
        if len(params) != len(prompts):
            raise PromptError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        out = []
        v = {}  # a Validator per distinct SamplingParams
        where = "prompt {}: " if len(prompts) > 1 else ""
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p = p if p is not None else SamplingParams()
            if p not in v:
                v[p] = self._validator(p)
                try:
                    v[p].check_vocab("stop_token_ids", p.stop_token_ids)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            try:  # a bare prompt is the line {kind: prompt, seed: its params' seed}: the same checks, and p as is
                if self.chat and isinstance(prompt, str):
                    prompt = user_message(prompt)
                line = prompt if isinstance(prompt, dict) else {kind_of(prompt): prompt, "seed": p.seed}
                check_unicode(line)  # a file's lines are checked as read; a lone surrogate fails in the tokenizer
                rec = v[p].record(line, i + 1)
            except ValueError as e:
                raise PromptError(f"{where.format(i)}{e}") from None
            out.append((list(rec.input_ids), rec.params, rec.id if isinstance(prompt, dict) else None))
        if not out:
            raise PromptError("no prompts given")
        return out

    def _validator(self, base: SamplingParams):
        from specrun.jobs.inputs import Validator

        return Validator(self.tokenizer, self.lm.max_context, self.lm.vocab_size, base)

    def _output(self, ids: list[int], params: SamplingParams, result, pid: str | None) -> Output:
        from specrun.models.loader import output_text

        return Output(list(result.token_ids), output_text(self.tokenizer, result.token_ids, result.finish_reason,
                                                          params), result.finish_reason, result.stats, ids, pid)


def _one_prompt(prompts) -> bool:
    """A bare list of token ids or of chat messages is one prompt, not several."""
    return isinstance(prompts, (list, tuple)) and bool(prompts) and (
        isinstance(prompts[0], int) or (isinstance(prompts[0], dict) and "role" in prompts[0]))

