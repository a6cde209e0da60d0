"""The 4-bit draft's static depth (quant_static.py), the CUDA graph's CPU twin: the slots it attends, its logits and
K/V against the eager draft's, and an engine drafting through it whose output is AR's."""

import pytest
import torch

from specrun.bench.neartie import check_divergence
from specrun.decoding.drafters import quant_static, quant_torch
from specrun.decoding.drafters.quant_static import StaticDraft, window_slots
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.runner import ModelRunner
from specrun.models.loader import load_model
from tests.decoding.test_attention import CUDA
from tests.decoding.test_quant_draft import GREEDY, PROMPT, SAMPLED, _on_grid, model_dir  # noqa: F401 (a fixture)


@pytest.mark.parametrize("keys", [7, 16])  # the window's slots, or rounded up to whole tiles
@pytest.mark.parametrize("n", [1, 3, 7, 8, 30])
def test_the_static_window_is_the_whole_text_then_the_sinks_and_the_last_slots(n, keys):
    slots, live = window_slots(torch.tensor([n]), keys, sinks=2, window=5)
    want = set(range(n)) if n <= 7 else {0, 1, *range(n - 5, n)}
    assert set(slots[live].tolist()) == want and int(live.sum()) == len(want)
    assert bool((slots < max(n, 1)).all())  # padding reads a slot the cache has


@pytest.mark.parametrize("window", [5, 4016])  # 2 sinks and 5 slots of the 13-token prompt; the whole of it
def test_the_static_depth_computes_the_eager_drafts_logits_and_kv(model_dir, monkeypatch, window):  # noqa: F811
    """Weights on the grid, float32: two drafted depths through StaticDraft (eagerly, as on a CPU) give the eager
    forward's rescored logits and write the same K/V at the same slots; with a short window both differ from a draft
    over the whole cache (the window is what both read)."""
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", window)
    lm = _on_grid(load_model(str(model_dir), dtype="float32"))
    runner = ModelRunner(lm, max_rows=16)
    runner.reset(64)
    runner.prefill(torch.tensor(PROMPT), 8)
    fwd = TorchForward.of(FusedDecoder.of(lm.model))
    n, every = runner.cache.length, ([None], [1.0], [1e9])  # every token a candidate
    runs = {}
    for name in ("eager", "static"):
        fwd.static = StaticDraft(fwd, graphs=False) if name == "static" else None
        runner.cache.k[:, :, n:], runner.cache.v[:, :, n:] = float("nan"), float("nan")  # each run writes its own
        fwd.begin([runner.cache], [n], 2)
        logits = [fwd.logits(i, [tok], *every)[0] for i, tok in enumerate((65, 66))]
        runs[name] = logits, runner.cache.k[:, :, n : n + 2].clone(), runner.cache.v[:, :, n : n + 2].clone()
    for got, want in zip(runs["static"][0], runs["eager"][0]):  # the same keys, attended in another order
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    for got, want in zip(runs["static"][1:], runs["eager"][1:]):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    monkeypatch.setattr(quant_torch, "WINDOW", 4016)
    fwd.static = None
    fwd.begin([runner.cache], [n], 2)
    whole = [fwd.logits(i, [tok], *every)[0] for i, tok in enumerate((65, 66))]
    gap = max(float((a - b).abs().max()) for a, b in zip(runs["static"][0], whole))
    assert gap > 0.05 if window == 5 else gap <= 1e-4 * float(whole[0].abs().max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_an_engine_drafting_through_the_static_depth_gives_ars_output(model_dir, params, device):  # noqa: F811
    """One sequence drafts through StaticDraft (on CUDA its CUDA graph, replayed), float32: the output is AR's and
    its drafts are accepted as the eager draft's are."""
    lm = _on_grid(load_model(str(model_dir), dtype="float32", device=device))
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
    dec = FusedDecoder.of(lm.model)
    dec._specrun_q4 = fwd = TorchForward.of(dec)
    fwd.static = StaticDraft(fwd)
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_draft="off"))
    result = engine.generate(PROMPT, params)
    assert engine.quant is fwd and result.token_ids == ar
    assert result.stats["mean_accepted"] > 3.0, result.stats
    if device == "cuda":
        assert fwd.static.graphs and fwd.static.replays > 0  # captured once, then replayed


def test_a_capture_that_fails_leaves_the_eager_draft_drafting(model_dir, monkeypatch):  # noqa: F811
    """Where the device refuses the graph (its function or its capture), a warning, and the eager forward drafts from
    then on: the output is AR's and the drafts are still accepted."""
    def refused(body, pool=None):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(quant_static, "capture_graph", refused)
    lm = _on_grid(load_model(str(model_dir), dtype="float32"))
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, GREEDY).token_ids
    dec = FusedDecoder.of(lm.model)
    dec._specrun_q4 = fwd = TorchForward.of(dec)
    fwd.static = StaticDraft(fwd, graphs=True)
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_draft="off"))
    with pytest.warns(RuntimeWarning, match="4-bit draft's CUDA graph failed"):
        result = engine.generate(PROMPT, GREEDY)
    assert fwd.static.failed and fwd.static.replays == 0
    assert result.token_ids == ar and result.stats["mean_accepted"] > 3.0, result.stats


@pytest.mark.gpu
@CUDA
def test_on_cuda_in_bf16_the_graph_replays_past_the_window(model_dir, monkeypatch):  # noqa: F811
    """bf16 on CUDA with a window of 2 sinks and 5 slots, so that the graph's sliding branch replays (the memory-
    efficient kernel under a bias over the gathered keys): captured without failing, and the output AR's up to near
    ties (bf16 verify rows round otherwise than AR's)."""
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", 5)
    lm = _on_grid(load_model(str(model_dir), dtype="bfloat16", device="cuda"))
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, SAMPLED).token_ids
    dec = FusedDecoder.of(lm.model)
    dec._specrun_q4 = fwd = TorchForward.of(dec)
    fwd.static = StaticDraft(fwd)
    got = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False)).generate(PROMPT, SAMPLED)
    assert not fwd.static.failed and fwd.static.replays > 0
    div = check_divergence(lm, PROMPT, SAMPLED, ar, got.token_ids)
    assert div is None or div.near_tie, div
