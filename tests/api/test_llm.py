"""specrun.LLM: generate (several prompts: one engine step for all) equals `specrun generate --json` prompt by
prompt; the stream yields exactly the final token ids and text (stop strings included); errors are SpecrunErrors;
import is cheap.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specrun
from specrun.cli import main

PROMPTS = ["abcabcabc", "Once upon a time", "The quick brown fox"]
FLAGS = ["--max-tokens", "40", "--temperature", "0.8", "--min-p", "0.05", "--seed", "4", "--ignore-eos",
         "--draft", "ngram,recycling"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return specrun.LLM(tiny_models["llama_gqa"], drafting="ngram,recycling", chat=False)  # as generate without --chat


@pytest.fixture(scope="module")
def params():
    return specrun.SamplingParams(max_tokens=40, temperature=0.8, min_p=0.05, seed=4, ignore_eos=True)


def test_generate_equals_cli_generate_json(tiny_models, llm, params):
    outs = llm.generate(PROMPTS, params)  # three at once: one engine step
    for prompt, out in zip(PROMPTS, outs):
        res = CliRunner().invoke(main, ["generate", "--model", tiny_models["llama_gqa"], "--prompt", prompt, "--json",
                                        *FLAGS], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        cli = json.loads(res.stdout)
        assert out.token_ids == cli["token_ids"]
        assert (out.text, out.finish_reason) == (cli["text"], cli["finish_reason"])
        assert set(out.stats) == set(cli["stats"])
        assert out.prompt_token_ids == llm.encode(prompt)
    # token ids as the prompt, and one prompt alone, give the same
    assert llm.generate(llm.encode(PROMPTS[1]), params)[0].token_ids == outs[1].token_ids


def test_the_engine_of_several_prompts_is_kept_for_later_calls_it_holds(llm, params):
    first = llm.generate(PROMPTS, params)
    engine = llm._batch
    asked = engine.asked
    again = llm.generate(PROMPTS[:2], params)  # fewer prompts, the same KV each: the kept engine runs them
    assert llm._batch is engine and engine.asked == asked + 2 * params.max_tokens
    assert [o.token_ids for o in again] == [o.token_ids for o in first[:2]]
    longer = dataclasses.replace(params, max_tokens=2 * params.max_tokens)
    more = llm.generate(PROMPTS, longer)  # more KV a sequence than its pages hold: a new engine
    assert llm._batch is not engine
    assert [o.token_ids[: params.max_tokens] for o in more] == [o.token_ids for o in first]


def test_prompts_the_kv_memory_holds_one_at_a_time_run_in_turn_on_the_one_prompt_engine(tiny_models, llm, params,
                                                                                        monkeypatch):
    batched = llm.generate(PROMPTS, params)
    fresh = specrun.LLM(tiny_models["llama_gqa"], drafting="ngram,recycling", chat=False)  # no engine kept yet
    monkeypatch.setattr("specrun.actors.memory.kv_budget_bytes", lambda device, workers: 1)  # room for one at a time

    def no_batch(*a, **k):
        raise AssertionError("an engine of several sequences was built for prompts that fit one at a time")

    monkeypatch.setattr("specrun.actors.memory.engine_for", no_batch)
    engine = fresh._solo()  # the engine of one prompt at a time, kept: its recycling matrix learns across calls
    in_turn = fresh.generate(PROMPTS, params)
    assert [o.token_ids for o in in_turn] == [o.token_ids for o in batched]
    assert engine.solo and engine.asked == len(PROMPTS) * params.max_tokens  # they ran on it, in turn
    fresh.generate(PROMPTS[::-1], params)
    assert fresh._engine is engine and engine.asked == 2 * len(PROMPTS) * params.max_tokens


def test_stream_yields_exactly_the_final_tokens_and_text(llm, params):
    full = llm.generate(PROMPTS[1], params)[0]
    stream = llm.stream(PROMPTS[1], params)
    deltas = list(stream)
    assert [t for d in deltas for t in d.token_ids] == full.token_ids == stream.output.token_ids
    assert "".join(d.text for d in deltas) == full.text == stream.output.text
    assert len(deltas) > 1  # token by token as accepted, not one lump at the end
    # with a stop string in the text: the stream stops where generate does and never shows the stop string
    half = full.text[len(full.text) // 2:]
    stop = next(half[i:i + 2] for i in range(len(half)) if "\ufffd" not in half[i:i + 2] and half[i:i + 2].strip())
    stopped = specrun.SamplingParams(**{**params.__dict__, "stop": (stop,)})
    want = llm.generate(PROMPTS[1], stopped)[0]
    stream = llm.stream(PROMPTS[1], stopped)
    deltas = list(stream)
    assert want.finish_reason == "stop" and stop not in want.text
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert "".join(d.text for d in deltas) == want.text


def test_errors_are_specrun_errors(llm):
    with pytest.raises(specrun.ModelError, match="cannot load model '/no/such/model'"):
        specrun.LLM("/no/such/model")
    with pytest.raises(specrun.PromptError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""])
    chat = specrun.LLM(llm.lm.path, drafting="ngram", chat=True)  # an empty text is refused as a user message too
    for call in (lambda: chat.generate(""), lambda: chat.generate(["fine", ""]), lambda: chat.stream("")):
        with pytest.raises(specrun.PromptError, match="prompt is empty"):
            call()
    with pytest.raises(specrun.SpecrunError, match="exceeds the model context"):
        llm.generate("x", specrun.SamplingParams(max_tokens=10**6))
    with pytest.raises(specrun.ConfigError, match="bogus"):
        specrun.LLM("demo", drafting="bogus")


@pytest.mark.parametrize("call, error, fault", [
    (lambda llm: specrun.LLM(123), specrun.ModelError, "model must be a directory path"),
    (lambda llm: specrun.LLM("demo", drafting=5), specrun.ConfigError, "drafting must be an EngineConfig"),
    (lambda llm: specrun.LLM("demo", max_concurrency=0), specrun.ConfigError, "max_concurrency=0"),
    (lambda llm: specrun.LLM("demo", chat="maybe"), specrun.ConfigError, "chat='maybe'"),
    (lambda llm: specrun.LLM("demo", chat=1), specrun.ConfigError, "chat=1"),
    (lambda llm: llm.generate(None), specrun.PromptError, "got NoneType"),
    (lambda llm: llm.generate(b"bytes"), specrun.PromptError, "got bytes"),
    (lambda llm: llm.generate("a", {"max_tokens": 4}), specrun.ConfigError, "must be a SamplingParams"),
    (lambda llm: llm.generate("\ud800"), specrun.PromptError, "lone surrogate"),
    (lambda llm: llm.generate("a", specrun.SamplingParams(stop_token_ids=(10**6,))), specrun.ConfigError,
     "stop_token_ids holds 1000000"),
    (lambda llm: specrun.SamplingParams(max_tokens=2.5), specrun.ConfigError, "must be an integer"),
    # a truthy string must not run a model's own code
    (lambda llm: specrun.LLM(llm.lm.path, trust_remote_code="no"), specrun.ModelError, "trust_remote_code='no'"),
    (lambda llm: specrun.EngineConfig(drafters="ngram"), specrun.ConfigError, "must be a tuple of drafter names"),
    (lambda llm: specrun.EngineConfig(trie_budget=5.5), specrun.ConfigError, "trie_budget=5.5 must be an integer"),
    (lambda llm: specrun.EngineConfig(trie_budget=10**8), specrun.ConfigError, "must be <= 1024"),
    (lambda llm: specrun.EngineConfig(tree=(1000, 1000, 1000)), specrun.ConfigError, "1,001,001,001 nodes"),
    (lambda llm: specrun.EngineConfig(tree="1,3"), specrun.ConfigError, "must be a tuple of integers"),
    (lambda llm: specrun.EngineConfig(adaptive_budget="no"), specrun.ConfigError, "adaptive_budget='no'"),
    (lambda llm: specrun.RunOptions(actors=-1), specrun.ConfigError, "actors=-1"),
    (lambda llm: specrun.RunOptions(quiet="no"), specrun.ConfigError, "quiet='no'"),
    (lambda llm: specrun.RunOptions(hot_start="/a/job"), specrun.ConfigError, "must be a list of job directories"),
])
def test_a_value_of_the_wrong_kind_is_a_specrun_error_where_it_is_given(llm, call, error, fault):
    """Not a TypeError from deep inside (a float max_tokens in torch.zeros, a dict for sampling read as one)."""
    with pytest.raises(error, match=fault):
        call(llm)


def test_values_of_other_legitimate_kinds_are_taken_as_given():
    """What a manifest's JSON, numpy or a caller's pathlib hands the configs: lists, numpy integers, paths, no limits."""
    config = specrun.EngineConfig(drafters=["ngram"], tree=[1, np.int64(3)], trie_budget=np.int64(8))
    assert config.drafters == ("ngram",) and config.tree == (1, 3) and type(config.trie_budget) is int
    opts = specrun.RunOptions(actors=np.int64(2), model_path=Path("/m"), load_timeout_s=float("inf"), stop_timeout_s=0)
    assert opts.actors == 2 and opts.model_path == "/m"  # attempts/ records it as JSON


def test_numpys_numbers_and_any_iterable_of_prompts_are_taken(llm, params):
    want = llm.generate(["a", "b"], params)
    assert [o.token_ids for o in llm.generate((p for p in ["a", "b"]), params)] == [o.token_ids for o in want]
    assert specrun.LLM("demo", max_concurrency=np.int64(2)).max_concurrency == 2


def test_demo_warns(specrun_cache):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specrun.LLM("demo")
    assert any("RANDOM-WEIGHT" in str(w.message) for w in caught)


def test_import_is_cheap():
    code = "import sys, specrun; print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_the_command_line_starts_without_torch():
    """`specrun --help`, a command's help and `status` load no torch, Ray or transformers (4 s here before they did)."""
    code = ("import sys\nfrom specrun.cli import main\nfor args in (['--help'], ['submit', '--help'], ['status', '/']):\n"
            "    try:\n        main(args)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'ray', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.endswith("\n[]\n") and "Examples" in out


def test_a_stream_being_read_holds_its_llm_until_it_ends_or_is_closed(llm, params):
    """generate() or a second stream() while a stream is part-read would step the stream's sequence too: refused,
    naming the stream; the stream then reads on to generate()'s tokens, and close() frees the LLM at once."""
    want = llm.generate(PROMPTS[0], params)[0]
    unread = llm.stream(PROMPTS[0], params)  # a stream holds its LLM from the start, before its first token
    with pytest.raises(specrun.SpecrunError, match="a stream of this LLM is still being read"):
        llm.stream(PROMPTS[1], params)
    assert [t for d in unread for t in d.token_ids] == want.token_ids
    llm.stream(PROMPTS[1], params)  # a stream dropped unread frees its LLM
    stream = llm.stream(PROMPTS[0], params)
    first = next(stream)
    for call in (lambda: llm.generate(PROMPTS[1], params), lambda: llm.stream(PROMPTS[1], params)):
        with pytest.raises(specrun.SpecrunError, match="a stream of this LLM is still being read"):
            call()
    assert first.token_ids + [t for d in stream for t in d.token_ids] == want.token_ids == stream.output.token_ids
    stream = llm.stream(PROMPTS[0], params)
    next(stream)
    stream.close()
    assert list(stream) == [] and stream.output is None
    assert llm.generate(PROMPTS[0], params)[0].token_ids == want.token_ids
    failing = llm.stream(PROMPTS[0], params)  # a generation that fails frees its LLM too
    failing._steps.close()
    failing._steps = _raising()
    with pytest.raises(RuntimeError, match="the generation failed"):
        next(failing)
    assert llm.generate(PROMPTS[0], params)[0].token_ids == want.token_ids


def _raising():
    raise RuntimeError("the generation failed")
    yield
