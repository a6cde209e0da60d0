"""The compiled self-draft (--compile): the torch draft's logits over its bf16 ring as the window slides and drafts
are committed, and an engine drafting through it emits AR's tokens."""

import shutil

import pytest
import torch

from specrun.decoding.drafters import quant_ring, quant_torch
from specrun.decoding.drafters.quant_ring import RingForward
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.runner import ModelRunner
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model
from tests.decoding.test_quant_draft import PROMPT, SAMPLED, _model, _on_grid, model_dir  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def smooth_dir(tmp_path_factory):
    """test_quant_draft's tiny model with weights of a trained model's size: a flipped bf16 rounding stays small."""
    return build_tiny_model(tmp_path_factory.mktemp("ring") / "llama", hidden=128, heads=4, kv_heads=2, layers=3,
                            seed=5, initializer_range=0.05)


pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor compiles C++: no compiler here")


@pytest.mark.parametrize("compiled,window,first", [(False, 5, 512), (False, 12, 4), (True, 5, 4)],
                         ids=["window 5", "window 12, the ring growing", "compiled, the ring growing"])
def test_the_ring_holds_what_the_torch_draft_attends_and_drafts_as_it_does(smooth_dir, monkeypatch, compiled, window,
                                                                           first):
    """2 sinks and a short window over a 13-token prompt: four drafts of 3 tokens, 2 of each committed (the target's own
    K/V replace the drafted ones), the ring starting at `first` slots past the sinks. Each drafted token attends
    exactly the sinks and the window's positions before it, each committed one holding the target's K/V (in bf16);
    its logits are the torch draft's over the target's cache so rounded, within 2% (the same arithmetic but for the
    order of float32 sums and, compiled, where bf16 intermediates are rounded)."""
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", window)
    monkeypatch.setattr(quant_ring, "FIRST_SPAN", first)
    lm = _on_grid(load_model(str(smooth_dir), dtype="float32"))
    runner = ModelRunner(lm, max_rows=16)
    runner.reset(64)
    runner.prefill(torch.tensor(PROMPT), 8)
    fwd = TorchForward.of(runner.decoder)
    ring = RingForward(fwd)
    if compiled:
        ring.warm()
        # the ring grows from 6 slots to 23: one graph for every length, none compiled past the warm-up
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    else:
        ring.fn = ring.graph
    every = ([None], [1.0], [1e9])  # every token a candidate
    for step in range(4):
        n = runner.cache.length
        for kv in (runner.cache.k, runner.cache.v):  # the values the ring holds
            kv.copy_(kv.bfloat16().float())
        tokens = [65 + step, 70, 75 + step]
        ring.begin([runner.cache], [n], 3)
        got = []
        for i, t in enumerate(tokens):
            seen = ring.pos[ring.visible(n + i)].sort().values.tolist()
            assert seen == [*range(2), *range(max(2, n + i + 1 - window), n + i)], (step, i)
            committed = torch.tensor([p for p in seen if p < n])
            slots = ring.slot(committed)
            assert torch.equal(ring.k[:, :, slots].float(), runner.cache.k[:, :, committed])
            assert torch.equal(ring.v[:, :, slots].float(), runner.cache.v[:, :, committed])
            got.append(ring.logits(i, [t], *every)[0])
        fwd.begin([runner.cache], [n], 3)
        want = [fwd.logits(i, [t], *every)[0] for i, t in enumerate(tokens)]
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g - w).abs().max() <= 0.02 * w.abs().max(), (step, i)
        runner.forward(torch.tensor(tokens), torch.arange(n, n + 3), torch.ones((3, 3), dtype=torch.bool).tril_())
        runner.cache.commit(torch.tensor([0, 1]))
    assert ring.calls == 12 and runner.cache.length == len(PROMPT) + 8
    assert ring.span == window + quant_ring.RESERVE  # grown to the whole window where it started shorter


def test_an_engine_with_compile_drafts_through_the_compiled_graph_and_emits_ar(model_dir, monkeypatch):  # noqa: F811
    """--compile: the solo engine's 4-bit chains come from the compiled graph (compiled when the engine starts, never
    during a generation), and its output is AR's."""
    lm = _model(model_dir, "torch", "float32")
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, SAMPLED).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_layers=True))
    ring = engine.drafters[0].forward
    assert isinstance(ring, RingForward) and ring.fn is not None
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    result = engine.generate(PROMPT, SAMPLED)
    assert result.token_ids == ar
    assert ring.calls > 0 and result.stats["mean_accepted"] > 3.0, result.stats
