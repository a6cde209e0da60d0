"""The drafting ceiling of sampled text: tokens per step of an oracle that drafts chains of AR's likeliest tokens."""

import pytest
import torch

from specrun.decoding.batch_engine import BatchConfig, BatchEngine
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.sampling import SamplingParams
from specrun.decoding.stats import ORACLE_DEPTHS, GenStats


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


def test_the_ceiling_is_the_texts_whatever_drafts_or_batching(load_fixture):
    lm = load_fixture("llama_gqa", dtype="float32")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the dog")
    params = SamplingParams(max_tokens=120, temperature=0.6, seed=4, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params)
    # recomputed from scratch: one causal forward over prompt + text, each row's argmax (no penalty or truncation:
    # the temperature alone keeps the likeliest token where it was)
    ids = torch.tensor([prompt + ar.token_ids])
    with torch.inference_mode():
        rows = lm.model(ids).logits[0, len(prompt) - 1 : -1]
    flags = (rows.argmax(-1) == torch.tensor(ar.token_ids)).tolist()
    assert 0 < sum(flags) < len(flags)  # a mixed text: the check below can tell depths apart
    want = {str(d): oracle_by_scan(flags, d) for d in ORACLE_DEPTHS}
    assert ar.stats["oracle_accepted"] == pytest.approx(want)
    spec = Engine(lm, EngineConfig(drafters=("ngram", "recycling"), trie_budget=8, adaptive_budget=False))
    drafted = spec.generate(prompt, params)
    assert drafted.token_ids == ar.token_ids and drafted.stats["mean_accepted"] > 1.0
    assert drafted.stats["oracle_accepted"] == pytest.approx(want)
    batch = BatchEngine(lm, EngineConfig(drafters=("ngram",)), BatchConfig(concurrency=2, kv_tokens=1024))
    got = batch.run([("a", prompt, params, []), ("b", prompt[:5], params, [])])
    assert got["a"].token_ids == ar.token_ids and got["a"].stats["oracle_accepted"] == pytest.approx(want)
