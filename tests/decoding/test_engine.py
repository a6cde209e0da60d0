"""Engine invariants on tiny offline models: I1 lossless (vs HF generate and our AR), I2 deterministic, KV equality."""

import dataclasses

import pytest
import torch
from scipy import stats

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.sampling import SamplingParams, process_logits
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model

FIXTURES = ["llama_mha", "llama_gqa", "qwen2", "qwen3", "mistral", "llama_bigvocab"]
DRAFTS = [(), ("ngram",), ("recycling",), ("ngram", "recycling")]
REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def chaotic_model(tmp_path_factory):
    """Large random weights make greedy text wander, so drafts mostly miss."""
    path = build_tiny_model(tmp_path_factory.mktemp("chaotic"), arch="llama", kv_heads=2, initializer_range=1.0, seed=3)
    return load_model(str(path), dtype="float64")


def load(tiny_models, name):
    return load_model(str(tiny_models[name]), dtype="float64")


def hf_greedy(lm, prompt_ids, n, repetition_penalty=1.0):
    with torch.inference_mode():
        out = lm.model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
            pad_token_id=0, repetition_penalty=repetition_penalty, attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids):].tolist()


def drafted(result) -> int:
    return sum(result.stats["tokens_by_drafter"].values())


@pytest.mark.parametrize("name", FIXTURES)
def test_greedy_equals_hf_generate_with_every_drafter_set(tiny_models, name):
    lm = load(tiny_models, name)
    prompt = lm.tokenizer.encode(REPETITIVE)
    n = 500
    ref = hf_greedy(lm, prompt, n)
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    for drafters in DRAFTS:
        res = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False)).generate(prompt, params)
        assert res.token_ids == ref, f"{name} {drafters}: first diff at " + str(
            next(i for i, (a, b) in enumerate(zip(res.token_ids, ref)) if a != b)
        )
        assert res.finish_reason == "length"
        if drafters:  # drafts were accepted often: a lossless test where nothing is accepted proves nothing
            assert res.stats["mean_accepted"] > 1.5, (drafters, res.stats)


def test_greedy_equals_hf_when_drafts_mostly_miss(chaotic_model):
    lm = chaotic_model
    prompt = lm.tokenizer.encode("a wandering prompt")
    n = 500
    ref = hf_greedy(lm, prompt, n, repetition_penalty=1.5)
    # a window longer than the text makes the contextual penalty HF's repetition penalty
    params = SamplingParams(max_tokens=n, ignore_eos=True, penalty=1.5, penalty_window=10_000)
    for drafters in DRAFTS[1:]:
        res = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False)).generate(prompt, params)
        assert res.token_ids == ref, drafters
        assert res.stats["mean_accepted"] < 1.6 and drafted(res) > 0, res.stats


@pytest.mark.parametrize("name,temperature", [("llama_gqa", 0.7), ("qwen3", 1.0)])  # each model, each temperature
def test_sampled_with_drafting_equals_sampled_without(tiny_models, name, temperature):
    lm = load(tiny_models, name)
    prompt = lm.tokenizer.encode(REPETITIVE)
    for extra in (dict(min_p=0.05), dict(top_p=0.9, top_k=40), dict(eta=0.001)):
        params = SamplingParams(
            max_tokens=300, temperature=temperature, penalty=1.2, penalty_window=32, seed=11, ignore_eos=True, **extra
        )
        ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params)
        for drafters in DRAFTS[1:]:
            res = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False)).generate(prompt, params)
            assert res.token_ids == ref.token_ids, (drafters, extra)
        assert drafted(res) > 0


def test_first_sampled_token_follows_the_processed_distribution(tiny_models):
    lm = load(tiny_models, "llama_mha")
    prompt = lm.tokenizer.encode("hello hello")
    engine = Engine(lm, EngineConfig())
    for penalty in (1.0, 1.8):
        params = SamplingParams(max_tokens=1, temperature=1.0, top_k=12, penalty=penalty, penalty_window=64)
        with torch.inference_mode():
            logits = lm.model(torch.tensor([prompt])).logits[0, -1:].double()
        present = torch.zeros_like(logits, dtype=torch.bool)
        present[0, prompt] = True
        probs = process_logits(logits, present, params).softmax(-1)[0]
        n = 1500
        counts = torch.zeros_like(probs)
        for seed in range(n):
            tok = engine.generate(prompt, dataclasses.replace(params, seed=seed)).token_ids[0]
            counts[tok] += 1
        kept = probs > 0
        assert counts[~kept].sum() == 0
        assert stats.chisquare(counts[kept].numpy(), (probs[kept] * n).numpy()).pvalue > 1e-3


def test_committed_kv_equals_ar_after_every_step(tiny_models):
    lm = load(tiny_models, "llama_gqa")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=()))
    ar_out = ar.generate(prompt, params).token_ids
    ref_k, ref_v = ar.runner.cache.k.clone(), ar.runner.cache.v.clone()

    spec = Engine(lm, EngineConfig(adaptive_budget=False))
    checked = []

    def check(_tokens):
        cache = spec.runner.cache
        n = cache.length
        assert torch.allclose(cache.k[:, :, :n], ref_k[:, :, :n], rtol=0, atol=1e-10)
        assert torch.allclose(cache.v[:, :, :n], ref_v[:, :, :n], rtol=0, atol=1e-10)
        checked.append(n)
        return False

    res = spec.generate(prompt, params, on_step=check)
    assert res.token_ids == ar_out
    assert len(checked) == res.stats["steps"] and res.stats["mean_accepted"] > 1.5


def test_resume_and_stop_are_invisible_in_the_output(tiny_models):
    lm = load(tiny_models, "qwen2")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = SamplingParams(max_tokens=150, temperature=1.0, min_p=0.1, seed=5, ignore_eos=True)
    engine = Engine(lm, EngineConfig())
    full = engine.generate(prompt, params).token_ids
    part = engine.generate(prompt, params, on_step=lambda toks: True)
    assert part.finish_reason == "stopped" and 1 <= len(part.token_ids) < 150
    assert part.token_ids == full[: len(part.token_ids)]
    for cut in (1, 37, 149):
        resumed = Engine(lm, EngineConfig(drafters=("ngram",))).generate(prompt, params, resume_from=full[:cut])
        assert resumed.token_ids == full
        assert resumed.stats["new_tokens"] == 150 - cut  # checkpointed tokens are re-prefilled, not regenerated
    done = engine.generate(prompt, params, resume_from=full)
    assert done.token_ids == full and done.finish_reason == "length" and done.stats["steps"] == 0


def test_steps_yield_each_step_and_two_generations_interleave(tiny_models):
    """Engine.steps: the yielded steps are generate()'s tokens in order, send(True) stops like on_step, and two engines
    stepped alternately (specrun bench's lockstep) produce what each produces alone."""
    lm = load(tiny_models, "qwen2")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = SamplingParams(max_tokens=60, temperature=1.0, min_p=0.1, seed=2, ignore_eos=True)
    config = {d: EngineConfig(drafters=d, adaptive_budget=False) for d in ((), ("ngram", "recycling"))}  # steps fixed
    alone = {d: Engine(lm, c).generate(prompt, params) for d, c in config.items()}
    gens = {d: Engine(lm, c).steps(prompt, params) for d, c in config.items()}
    seen, results, live = {d: [] for d in gens}, {}, list(gens)
    while live:
        for d in list(live):
            try:
                seen[d].append(next(gens[d]) if not seen[d] else gens[d].send(False))
            except StopIteration as end:
                results[d] = end.value
                live.remove(d)
    for d, res in alone.items():
        assert results[d].token_ids == res.token_ids == [t for step in seen[d] for t in step]
        assert len(seen[d]) == results[d].stats["steps"] == res.stats["steps"]
    gen = Engine(lm, EngineConfig()).steps(prompt, params)
    first = next(gen)
    with pytest.raises(StopIteration) as end:
        gen.send(True)
    assert end.value.value.finish_reason == "stopped" and end.value.value.token_ids == first


def test_eos_stops_unless_ignored(tiny_models):
    lm = load(tiny_models, "llama_mha")
    prompt = lm.tokenizer.encode("abc")
    free = Engine(lm, EngineConfig()).generate(prompt, SamplingParams(max_tokens=120, ignore_eos=True)).token_ids
    eos = free[40]
    first = free.index(eos)
    lm_eos = dataclasses.replace(lm, eos_ids=frozenset({eos}))
    for drafters in DRAFTS:
        res = Engine(lm_eos, EngineConfig(drafters=drafters)).generate(prompt, SamplingParams(max_tokens=120))
        assert res.token_ids == free[: first + 1] and res.finish_reason == "eos"
        ignored = Engine(lm_eos, EngineConfig(drafters=drafters)).generate(
            prompt, SamplingParams(max_tokens=120, ignore_eos=True)
        )
        assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_recycling_hot_start_carries_over_and_changes_nothing(tiny_models):
    lm = load(tiny_models, "llama_gqa")
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    warm = Engine(lm, EngineConfig(drafters=("recycling",), adaptive_budget=False))
    warm.generate(lm.tokenizer.encode(REPETITIVE), params)
    prompt2 = lm.tokenizer.encode("the mat sat on the cat")
    cold = Engine(lm, EngineConfig(drafters=("recycling",), adaptive_budget=False)).generate(prompt2, params)
    restored = Engine(lm, EngineConfig(drafters=("recycling",), adaptive_budget=False))
    restored.recycling.load_state_dict(warm.recycling.state_dict())
    again = warm.generate(prompt2, params)
    assert again.token_ids == cold.token_ids
    assert restored.generate(prompt2, params).token_ids == cold.token_ids
    assert torch.equal(restored.recycling.matrix, warm.recycling.matrix)  # same history -> same state


def test_bad_inputs_are_refused_with_the_value(tiny_models):
    lm = load(tiny_models, "llama_bigvocab")
    engine = Engine(lm, EngineConfig())
    with pytest.raises(ValueError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match=str(engine.vocab_size + 5)):
        engine.generate([engine.vocab_size + 5], SamplingParams())
    with pytest.raises(ValueError, match="context"):
        engine.generate([1, 2], SamplingParams(max_tokens=lm.max_context))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="bogus"):
        EngineConfig(drafters=("bogus",))


def test_a_sequence_near_its_end_verifies_no_more_nodes_than_tokens_it_may_take(tiny_models, monkeypatch):
    """k tokens from its end a sequence takes at most k a step (the root's and a chain of k - 1): its trie holds no
    more nodes, so a one-token request drafts nothing. Alone and beside a longer one, outputs are AR's."""
    from specrun.decoding.engine import BatchConfig

    lm = load(tiny_models, "llama_gqa")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (1, 7, 40)]
    ar = [Engine(lm, EngineConfig(drafters=())).generate(prompt, p).token_ids for p in params]
    for batch in (BatchConfig(), BatchConfig(concurrency=3, kv_tokens=3 * 128, page_size=32)):
        engine = Engine(lm, EngineConfig(adaptive_budget=False), batch)
        steps, verify = [], engine._verify

        def spy(live):
            steps.append([(a.st.params.max_tokens, a.trie.size, a.st.left) for a in live])
            return verify(live)

        monkeypatch.setattr(engine, "_verify", spy)
        if batch.concurrency == 1:
            got = [engine.generate(prompt, p).token_ids for p in params]
            assert steps[0] == [(1, 1, 1)]  # the one-token request: its root alone
        else:
            out = engine.run([(i, prompt, p, []) for i, p in enumerate(params)])
            got = [out[i].token_ids for i in range(3)]
        assert got == ar
        rows = [r for step in steps for r in step]
        assert all(size <= left for _, size, left in rows), rows
        assert any(size > 1 for n, size, _ in rows if n == 40)  # the long one drafted
