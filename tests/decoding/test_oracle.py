"""Sampled text: tokens per step of an oracle drafting chains of AR's likeliest tokens, counted over the emitted text."""

import dataclasses

import pytest
import torch

from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.stats import ORACLE_DEPTHS, GenStats
from specrun.decoding.verify.sampling import SamplingParams, process_logits
from specrun.decoding.verify.trie import likeliest
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model


def oracle_by_scan(likeliest: list[bool], depth: int) -> float:
    """Tokens per step, stepping through the text: a step takes its root's sampled token, then one more token for
    each drafted likeliest token the text went on with, `depth` at most."""
    steps, i = 0, 0
    while i < len(likeliest):
        steps += 1
        went_on = 0
        while i < len(likeliest) and likeliest[i] and went_on < depth:
            went_on, i = went_on + 1, i + 1
        i += 1  # the token sampled where the chain stopped (a miss, or the chain's last row) ends the step
    return len(likeliest) / steps


@pytest.mark.parametrize("flags, want", [
    ([True, True, False, True, False, False], {1: 6 / 4, 2: 6 / 3, 4: 6 / 3, 8: 6 / 3}),
    ([True] * 9, {1: 9 / 5, 2: 9 / 3, 4: 9 / 2, 8: 9 / 1}),
    ([False] * 5, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}),
])
def test_oracle_steps_through_the_text(flags, want):
    s = GenStats(())
    for i in range(0, len(flags), 2):  # fed in pieces, as steps emit them: the open chain carries over
        s.record_likeliest(flags[i : i + 2])
    got = {int(d): v for d, v in s.as_dict()["oracle_accepted"].items()}
    assert got == pytest.approx(want) and got == pytest.approx({d: oracle_by_scan(flags, d) for d in ORACLE_DEPTHS})
    assert s.as_dict()["likeliest_share"] == pytest.approx(sum(flags) / len(flags))


def test_greedy_text_has_no_ceiling_to_report(load_fixture):
    lm = load_fixture("llama_gqa", dtype="float32")
    st = Engine(lm, EngineConfig(drafters=())).generate(lm.tokenizer.encode("abc"), SamplingParams(max_tokens=8)).stats
    assert st["oracle_accepted"] is None and st["likeliest_share"] is None


def test_likeliest_reads_the_rows_of_the_path_nodes():
    processed = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])  # [T=4, V=3]
    choice = torch.tensor([1, 1, 1, 0])
    # the path skips node 1, whose row would say otherwise
    assert likeliest(processed, choice, torch.tensor([0, 2, 3])) == [True, False, True]


def flags_of(lm, prompt, text, params):
    """From scratch: one causal forward over prompt + text; each row processed as AR does (penalty over the window of
    the tokens before it, temperature, min-p), then was the text's token that row's likeliest."""
    ids = prompt + text
    with torch.inference_mode():
        rows = lm.model(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].float()  # row i samples text[i]
    present = torch.zeros_like(rows, dtype=torch.bool)
    for i in range(len(text)):
        n = len(prompt) + i
        present[i, ids[max(0, n - params.penalty_window) : n]] = True
    return (process_logits(rows, present, params).argmax(-1) == torch.tensor(text)).tolist()


def test_the_oracle_is_the_emitted_texts_whatever_drafts_batching_or_cuts(tmp_path):
    # peaked random weights (as test_acceptance.py): the likeliest token is often sampled, and the penalty moves it
    lm = load_model(str(build_tiny_model(tmp_path / "m", kv_heads=2, seed=3, initializer_range=0.3)), dtype="float32")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the dog")
    params = SamplingParams(max_tokens=120, temperature=0.6, min_p=0.05, penalty=2.0, penalty_window=16, seed=4,
                            ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params)
    flags = flags_of(lm, prompt, ar.token_ids, params)
    plain = SamplingParams(max_tokens=120, temperature=0.6, seed=4, ignore_eos=True)
    assert flags != flags_of(lm, prompt, ar.token_ids, plain)  # the penalty moved some rows' likeliest token
    assert 0 < sum(flags) < len(flags)  # a mixed text: the depths differ

    def want(n):
        return {str(d): oracle_by_scan(flags[:n], d) for d in ORACLE_DEPTHS}

    assert ar.stats["oracle_accepted"] == pytest.approx(want(120))
    config = EngineConfig(drafters=("ngram", "recycling"), trie_budget=8, adaptive_budget=False)
    steps = []
    drafted = Engine(lm, config).generate(prompt, params, on_step=lambda emitted: steps.append(len(emitted)))
    assert drafted.token_ids == ar.token_ids and drafted.stats["oracle_accepted"] == pytest.approx(want(120))
    # a stop token inside a multi-token step (the engine never drafts past max_tokens): only what it emits counts
    ends, text = torch.tensor(steps).cumsum(0).tolist(), ar.token_ids
    cut = next(e - k + j for e, k in zip(ends, steps) for j in range(k - 1) if text[e - k + j] not in text[: e - k + j])
    short = Engine(lm, config).generate(prompt, dataclasses.replace(params, stop_token_ids=(text[cut],)))  # same steps
    n = len(short.token_ids)
    assert short.finish_reason == "stop" and n <= cut + 1 and short.token_ids == text[:n]
    assert short.stats["oracle_accepted"] == pytest.approx(want(n))
    batch = Engine(lm, EngineConfig(drafters=("ngram",)), BatchConfig(concurrency=2, kv_tokens=1024))
    got = batch.run([("a", prompt, params, []), ("b", prompt[:5], params, [])])
    assert got["a"].token_ids == ar.token_ids and got["a"].stats["oracle_accepted"] == pytest.approx(want(120))
