"""Compiled layers (inductor, weights frozen in): the eager layers' results within rounding, padded rows invisible in
the cache, no compile inside a forward, and engines through them (solo and batched) emit their plain AR tokens."""

import shutil

import pytest
import torch

from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.compiled import BUCKETS, bucket_of
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.verify.sampling import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor compiles C++: no compiler here")

WARM = 4  # buckets 1, 2, 4: each compiles once per model object (module-scoped models below)


@pytest.fixture(scope="module")
def models(tiny_models):
    """Float32 qwen3 (GQA, q/k norms), loaded once: its decoder's buckets compile once for the module (~10 s each)."""
    from specrun.models.loader import load_model

    loaded = {name: load_model(tiny_models[name], dtype="float32") for name in ("qwen3",)}
    for lm in loaded.values():
        runner = ModelRunner(lm, max_rows=16)
        runner.use_compiled(WARM)
        if runner.decoder.cpu_layers is not None:
            pytest.skip("our C kernels run the layers on this CPU (they stay the path)")
    return loaded


def test_buckets():
    assert [bucket_of(r) for r in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64] and bucket_of(BUCKETS[-1] + 1) is None


def test_compiled_forward_matches_eager_and_padded_rows_write_nothing(models):
    lm = models["qwen3"]
    eager, comp = ModelRunner(lm, max_rows=16), ModelRunner(lm, max_rows=16)
    comp.compiled = True  # the decoder's buckets are compiled (fixture)
    prompt = torch.arange(3, 40)
    for r in (eager, comp):
        r.reset(128)
        r.prefill(prompt, 16)
    S = prompt.shape[0]
    toks, pos = torch.tensor([5, 9, 11]), torch.tensor([S, S + 1, S + 1])  # a trie: two children of the first
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    compiled = comp.decoder.compiled
    calls = compiled.calls
    he, hc = eager.forward(toks, pos, tree), comp.forward(toks, pos, tree)  # 3 rows: bucket 4, one row padded
    assert compiled.calls == calls + 1
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=1e-4)
    for kv_c, kv_e in ((comp.cache.k, eager.cache.k), (comp.cache.v, eager.cache.v)):
        torch.testing.assert_close(kv_c[:, :, : S + 3], kv_e[:, :, : S + 3], rtol=1e-4, atol=1e-4)
        assert not kv_c[:, :, S + 3 :].any()  # the padded row attended nothing and wrote no slot


def test_a_forward_never_compiles_an_unwarmed_bucket(models):
    lm = models["qwen3"]
    runner = ModelRunner(lm, max_rows=16)
    runner.compiled = True
    compiled = runner.decoder.compiled
    before, calls = dict(compiled.compile_seconds), compiled.calls
    runner.reset(64)
    runner.prefill(torch.arange(3, 11), 8)  # 8 rows: bucket 8 was not warmed, so the eager layers run it
    assert compiled.compile_seconds == before and compiled.calls == calls
    assert sorted(before) == [1, 2, 4]


def test_engines_through_compiled_layers_emit_their_ar_tokens(models):
    lm = models["qwen3"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompt = list(lm.tokenizer("the cat sat on the mat. the cat sat on the mat. the cat").input_ids)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    compiled = lm.model._specrun_decoder.compiled
    calls = compiled.calls
    spec = Engine(lm, EngineConfig(drafters=("ngram",), trie_budget=WARM, compile_layers=True)).generate(prompt, params)
    assert spec.token_ids == ar and compiled.calls > calls
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    want = Engine(lm, EngineConfig(drafters=())).generate(prompt, sampled).token_ids
    calls = compiled.calls
    batch = Engine(lm, EngineConfig(drafters=("ngram",), trie_budget=2, compile_layers=True),
                   BatchConfig(concurrency=2, kv_tokens=512))
    out = {k: r.token_ids for k, r in batch.run([(0, prompt, sampled, []), (1, prompt, params, [])]).items()}
    assert out == {0: want, 1: ar} and compiled.calls > calls
    assert sorted(compiled.compile_seconds) == [1, 2, 4]  # nothing compiled beyond the warmed buckets
