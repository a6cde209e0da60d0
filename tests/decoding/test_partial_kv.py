"""Partial KV selection against brute force (MHA, GQA), rebuild timing, and the query it is built from."""

import pytest
import torch

from specrun.decoding.drafters.heads import DraftHeads
from specrun.decoding.drafters.partial_kv import PartialKV, importance, select_top
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.verify.params import SamplingParams


@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 1)])
def test_selection_equals_brute_force_top_k(hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    L, D, B, S = 50, 8, 12, 3
    q = torch.randn(hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(L, hkv, D, generator=g, dtype=torch.float64)
    got = select_top(importance(q, k.transpose(0, 1)), B, S)
    group = hq // hkv
    for h in range(hkv):
        scores = [sum(float(q[h * group + j] @ k[i, h]) for j in range(group)) for i in range(L)]
        ranked = sorted(range(S, L), key=lambda i: -scores[i])[: B - S]
        assert got[h].tolist() == list(range(S)) + ranked


def fake_cache(L, layers=2, hkv=2, d=4, cap=200):
    cache = KVCache(layers, cap, hkv, d, torch.float64, "cpu")
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.length = L
    return cache


def test_dynamic_rebuilds_exactly_when_overwrites_reach_the_sinks():
    B, S = 8, 2
    kv = PartialKV("dynamic", B, S)
    cache = fake_cache(6)
    q = lambda: torch.randn(2, 2, 4, dtype=torch.float64)  # noqa: E731
    assert kv.refresh(cache, q) is None  # committed length within the budget: attend to everything
    cache.length = 10
    first = kv.refresh(cache, q).clone()
    assert kv.rebuilds == 1 and first.shape == (2, 2, B)
    for step in range(1, B - S + 1):  # B-S new tokens overwrite entries B-1, B-2, ..., S
        cache.length += 1
        slots = kv.refresh(cache, q)
        assert kv.rebuilds == 1
        assert (slots[:, :, B - step] == cache.length - 1).all()  # the newest token took the next tail entry
        assert torch.equal(slots[:, :, : B - step], first[:, :, : B - step])  # the rest is untouched
    cache.length += 1  # the next overwrite would hit a sink: recompute over the whole cache
    kv.refresh(cache, q)
    assert kv.rebuilds == 2


def test_static_partial_never_rebuilds():
    kv = PartialKV("partial", 8, 2)
    cache = fake_cache(10)
    q = lambda: torch.randn(2, 2, 4, dtype=torch.float64)  # noqa: E731
    kv.refresh(cache, q)
    for _ in range(30):
        cache.length += 1
        slots = kv.refresh(cache, q)
        assert (slots[:, :, :2] == torch.arange(2)).all()  # sinks stay
        assert (slots == cache.length - 1).any(-1).all()  # the newest token is always in
    assert kv.rebuilds == 1


def test_rebuild_uses_the_last_committed_query(load_fixture, monkeypatch):
    lm = load_fixture("llama_gqa")
    heads = DraftHeads(64, 3).double()
    engine = Engine(lm, EngineConfig(drafters=("heads", "ngram"), kv_mode="dynamic", kv_budget=20, kv_sinks=4, adaptive_budget=False), heads=heads)
    seen = []
    original = PartialKV._rebuild

    def spy(kv, cache, q_last):
        seen.append((cache.length, q_last().clone()))
        original(kv, cache, q_last)

    monkeypatch.setattr(PartialKV, "_rebuild", spy)
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat")
    out = engine.generate(prompt, SamplingParams(max_tokens=120, ignore_eos=True)).token_ids
    assert len(seen) >= 3
    seq = torch.tensor(prompt + out)
    ref = Engine(lm, EngineConfig(drafters=()))
    for length, q in seen:
        ref.runner.runner.reset(length + 8)  # the engine's ModelRunner
        ref.runner.runner.prefill(seq[:length], chunk=256, capture_queries=True)
        q_ref = torch.stack([layer_q[:, -1] for layer_q in ref.runner.runner.queries])
        assert torch.allclose(q, q_ref, atol=1e-10)  # the committed token's own query, never a draft node's
