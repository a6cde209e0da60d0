"""Compiled layers (AOTInductor packages, weights frozen in): the eager layers' results within rounding, no compile
inside a forward, a later process loads the packages (holding no copy of the model's weights) and gets the same rows,
and engines through them (solo and batched) emit their plain AR tokens."""

import json
import shutil
import time
import zipfile

import pytest
import torch

from specrun.bench.neartie import ar_scores
from specrun.decoding.config import COMPILE_LAYERS_TOKENS
from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.compiled import MAX_ROWS, CompiledLayers, _key
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.verify.params import SamplingParams

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor compiles C++: no compiler here")

WARM = 4  # rows a forward: both packages (one row, several), built once per session cache


@pytest.fixture(scope="module")
def models(tiny_models, own_cache):
    """Float32 qwen3 (GQA, q/k norms), loaded once: its decoder's packages are built once (~20 s each)."""
    from specrun.models.loader import load_model

    loaded = {name: load_model(tiny_models[name], dtype="float32") for name in ("qwen3",)}
    for lm in loaded.values():
        runner = ModelRunner(lm, max_rows=16)
        runner.use_compiled(WARM)
        if runner.decoder.cpu_layers is not None:
            pytest.skip("our C kernels run the layers on this CPU (they stay the path)")
    return loaded


def test_packages_of_row_counts():
    assert [_key(r) for r in (1, 2, 3, 64, MAX_ROWS + 1)] == [1, 0, 0, 0, None]


def test_compiled_forward_matches_eager_and_writes_its_rows_only(models):
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
    he, hc = eager.forward(toks, pos, tree), comp.forward(toks, pos, tree)  # 3 rows: the several-rows package
    assert compiled.calls == calls + 1
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=1e-4)
    for kv_c, kv_e in ((comp.cache.k, eager.cache.k), (comp.cache.v, eager.cache.v)):
        torch.testing.assert_close(kv_c[:, :, : S + 3], kv_e[:, :, : S + 3], rtol=1e-4, atol=1e-4)
        assert not kv_c[:, :, S + 3 :].any()


def test_a_forward_never_compiles(models):
    """One row warmed: a forward of several runs eagerly (nothing built), and so does one past MAX_ROWS."""
    lm = models["qwen3"]
    runner = ModelRunner(lm, max_rows=MAX_ROWS + 8)
    single = CompiledLayers(runner.decoder)
    single.warm(1)
    assert sorted(single.load_seconds) == [1] and not single.compile_seconds  # the fixture built it
    runner.decoder.compiled, kept = single, runner.decoder.compiled
    try:
        runner.compiled = True
        runner.reset(256)
        runner.prefill(torch.arange(3, 11), 8)  # 8 rows: not warmed here
        runner.prefill(torch.arange(3, 4 + MAX_ROWS), MAX_ROWS + 8)  # more rows than any package takes
        assert single.calls == 0 and sorted(single._fns) == [1]
    finally:
        runner.decoder.compiled = kept


def test_a_later_process_loads_the_packages_which_hold_no_copy_of_the_weights(models):
    """A fresh CompiledLayers of the same model (as a new process makes) loads both packages from the cache, builds
    nothing, and computes the same rows bit for bit; a package stores the packed weights, not the model's own."""
    lm = models["qwen3"]
    runner = ModelRunner(lm, max_rows=16)
    first = runner.decoder.compiled
    later = CompiledLayers(runner.decoder)
    later.warm(WARM)
    assert sorted(later.load_seconds) == [0, 1] and not later.compile_seconds
    runner.compiled = True
    for rows in (1, 5):
        runner.reset(64)
        runner.prefill(torch.arange(3, 20), 16)
        toks, pos = torch.arange(7, 7 + rows), torch.arange(17, 17 + rows)
        tree = torch.ones(rows, rows, dtype=torch.bool).tril()
        runner.decoder.compiled = first
        try:
            a = runner.forward(toks, pos, tree)  # writes the slots after the prompt, commits nothing
            runner.decoder.compiled = later
            b = runner.forward(toks, pos, tree)
        finally:
            runner.decoder.compiled = first
        assert torch.equal(a, b) and later.calls >= 1
    for key in (0, 1):
        with zipfile.ZipFile(later.path(key)) as z:
            stored = {i.filename.rsplit("/", 1)[-1] for i in z.infolist() if "/data/weights/" in i.filename}
            config = next(n for n in z.namelist() if n.endswith("weights_config.json"))
            files = {name: f for name, (f, *_) in json.loads(z.read(config)).items()}
        assert any(name in files for name in later.shared)  # the model's weights are constants of the package
        assert files and all(name in later.shared for name, f in files.items() if f not in stored)
        assert not any(files[name] in stored for name in later.shared if name in files)  # none of the model's own
        assert len(stored) >= 4 * len(lm.model.model.layers)  # the packed products, four a layer


def test_compiled_head_gives_each_row_its_one_row_logits(models):
    """The LM head's packages (built beside the layers'): a row's logits do not depend on the rows beside it (the
    one-row package's, bit for bit), equal the eager head's within rounding, and a runner's logits go through them
    only where its layers run compiled."""
    lm = models["qwen3"]
    runner = ModelRunner(lm, max_rows=16)
    runner.use_compiled(WARM)
    head = runner.decoder.compiled_head
    assert runner.compiled and sorted(head._fns) == [0, 1]
    hidden = torch.randn(5, lm.model.config.hidden_size)
    calls = head.calls
    rows = runner.logits(hidden)  # the several-rows package
    for i in range(5):
        assert torch.equal(runner.logits(hidden[i : i + 1]), rows[i : i + 1])  # the one-row package
    assert head.calls == calls + 6
    torch.testing.assert_close(rows, runner.decoder.lm_head(hidden).float(), rtol=1e-4, atol=1e-4)
    runner.compiled = False
    assert torch.equal(runner.logits(hidden), runner.decoder.lm_head(hidden).float()) and head.calls == calls + 6


def test_keep_faster_times_the_head_with_the_caches_evicted_and_the_layers_as_they_run(models, monkeypatch):
    """The head's weights stay cached while it is timed alone, not in a step (the layers' pass between): its
    keep_faster evicts the caches before every timed call; the layers' (larger than a cache) does not."""
    from specrun.decoding.forward import row_packages

    runner = ModelRunner(models["qwen3"], max_rows=16)
    runner.use_compiled(WARM)
    dec, evictions = runner.decoder, []
    monkeypatch.setattr(row_packages, "_evict", lambda: evictions.append(1))
    for part, eager, cold in ((dec.compiled_head, dec.lm_head, True), (dec.compiled, dec.layer_stack, False)):
        part.served.clear()
        part.timings.clear()
        before = len(evictions)
        part.keep_faster(eager, 16, rounds=2)
        assert part.timings and len(evictions) - before == (2 * 3 * len(part.timings) if cold else 0)
        part.served.clear()  # as the fixture left them: every row count served
        part.warm(WARM)


def test_engines_through_compiled_layers_emit_their_ar_tokens(models):
    lm = models["qwen3"]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompt = list(lm.tokenizer("the cat sat on the mat. the cat sat on the mat. the cat").input_ids)
    eager = EngineConfig(drafters=(), compile_layers="off")
    ar = Engine(lm, eager).generate(prompt, params).token_ids
    compiled, head = lm.model._specrun_decoder.compiled, lm.model._specrun_decoder.compiled_head
    calls, head_calls = compiled.calls, head.calls
    spec = Engine(lm, EngineConfig(drafters=("ngram",), trie_budget=WARM, compile_layers="on")).generate(prompt, params)
    assert spec.token_ids == ar and compiled.calls > calls and head.calls > head_calls
    sampled = SamplingParams(max_tokens=40, temperature=1.0, seed=3)
    want = Engine(lm, eager).generate(prompt, sampled).token_ids
    calls = compiled.calls
    batch = Engine(lm, EngineConfig(drafters=("ngram",), trie_budget=2, compile_layers="on"),
                   BatchConfig(concurrency=2, kv_tokens=512))
    out = {k: r.token_ids for k, r in batch.run([(0, prompt, sampled, []), (1, prompt, params, [])]).items()}
    assert out == {0: want, 1: ar} and compiled.calls > calls
    assert sorted(compiled._fns) == [0, 1]  # the engines built nothing more


def test_compile_layers_auto_loads_what_is_cached_and_builds_only_for_long_runs(models, tiny_models, tmp_path,
                                                                               monkeypatch, capsys):
    """auto: where the packages are cached an engine runs through them from its first generation (the tokens "on"
    gives); with none cached nothing builds short of COMPILE_LAYERS_TOKENS (would_build names the layers from there,
    in bfloat16 too); a failed build is said once and the eager layers serve."""
    from specrun.decoding.forward import compiled
    from specrun.models.loader import load_model

    lm = load_model(tiny_models["qwen3"], dtype="float32")  # as a new process: the fixture's packages on disk only
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    prompt = list(lm.tokenizer("the cat sat on the mat. the cat").input_ids)
    auto = Engine(lm, EngineConfig(drafters=()))
    assert not auto.runner.compiled and auto.would_build(10) == []
    result = auto.generate(prompt, params)
    got, layers = result.token_ids, auto.runner.decoder.compiled
    assert auto.runner.compiled and layers.calls > 0 and sorted(layers.load_seconds) == [1] and not layers.compile_seconds
    assert result.stats["compiled_layers"] is True  # what a job's output row records
    assert got == Engine(lm, EngineConfig(drafters=(), compile_layers="on")).generate(prompt, params).token_ids

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))  # nothing cached
    fresh = load_model(tiny_models["qwen3"], dtype="float32")
    engine = Engine(fresh, EngineConfig(drafters=()))
    assert engine.would_build(COMPILE_LAYERS_TOKENS - 1) == []
    assert engine.would_build(COMPILE_LAYERS_TOKENS) == ["the layers"]
    assert engine.generate(prompt, params).stats["compiled_layers"] is False
    assert not engine.runner.compiled and not (tmp_path / "layers").exists()
    off = Engine(fresh, EngineConfig(drafters=(), compile_layers="off"))
    assert off.would_build(10 * COMPILE_LAYERS_TOKENS) == []
    bf16 = Engine(load_model(tiny_models["qwen3"], dtype="bfloat16"), EngineConfig(drafters=()))
    assert bf16.would_build(COMPILE_LAYERS_TOKENS - 1) == []
    assert bf16.would_build(COMPILE_LAYERS_TOKENS) == ["the layers"]

    tries = []

    def fail(self, key, where):
        tries.append(key)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled.CompiledLayers, "_build", fail)
    for _ in range(2):
        engine.expect(COMPILE_LAYERS_TOKENS)
    assert tries == [1] and not engine.runner.compiled  # tried once, then the eager layers
    assert "the layers did not compile (RuntimeError: no compiler here); they run eagerly" in capsys.readouterr().err
    assert engine.generate(prompt, params).token_ids


def _eager_slow_to(rows: int):
    """A stand-in for the eager layers that takes 50 ms on up to `rows` rows and no time on more."""
    return lambda x, cos, sin, ctx: time.sleep(0.05) if x.shape[0] <= rows else None


def test_compile_layers_auto_in_bfloat16_keeps_only_the_packages_that_beat_the_eager_layers(tiny_models, own_cache,
                                                                                           monkeypatch):
    """keep_faster drops a package its eager rival outran (its forwards run eagerly, warm loads it no more), keeps
    one that won, and serves the several-rows package's forwards up to the most rows it won at; an auto engine in
    bfloat16 takes that choice (on takes both, untimed), and with every package dropped it runs eagerly and loads none
    again."""
    from specrun.decoding.forward import aot_package, compiled
    from specrun.models.loader import load_model

    lm = load_model(tiny_models["qwen3"], dtype="bfloat16")
    runner = ModelRunner(lm, max_rows=16)
    runner.use_compiled(WARM)  # as compile_layers on: both packages, untimed
    layers = runner.decoder.compiled
    if layers is None:
        pytest.skip("our C kernels run the layers on this CPU (they stay the path)")
    assert runner.compiled and sorted(layers._fns) == [0, 1] and layers.timings == {} and layers.covers(64)
    layers.keep_faster(_eager_slow_to(1))
    assert layers.dropped == {0} and layers.covers(1) and not layers.covers(2) and layers.runs
    assert layers.timings[1][0] > layers.timings[1][1] and layers.timings[4][0] < layers.timings[4][1]
    assert sorted(layers.timings) == [1, 4]  # timing stops at the first row count eager wins
    layers.warm(WARM)
    assert sorted(layers._fns) == [1]  # the dropped package is not loaded again

    for slow_rows, max_rows, timed_rows, served in ((8, 64, [1, 4, 8, 16], 8), (64, 16, [1, 4, 8, 16], 16)):
        several = compiled.CompiledLayers(runner.decoder)  # another process's: the packages loaded from the cache
        several.warm(WARM)
        several.keep_faster(_eager_slow_to(slow_rows), max_rows)  # eager wins above slow_rows; none above max_rows'
        assert sorted(several.timings) == timed_rows and several.served == {1: 1, 0: served} and not several.dropped
        assert [several.covers(r) for r in (1, 2, 8, 9, 16, 17)] == [True] * 3 + [served > 8] * 2 + [False]

    timed = compiled.CompiledLayers.keep_faster
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    prompt = list(lm.tokenizer("the cat sat on the mat. the cat").input_ids)
    config = EngineConfig(drafters=("ngram",), trie_budget=WARM)
    for slow_rows, kept in ((1, [1]), (0, [])):  # the eager layers lose at one row, then at no row count
        monkeypatch.setattr(compiled.CompiledLayers, "keep_faster",
                            lambda self, eager, max_rows, rows=slow_rows: timed(self, _eager_slow_to(rows), max_rows))
        later = load_model(tiny_models["qwen3"], dtype="bfloat16")  # a new process's: the packages cached
        engine = Engine(later, config)
        result = engine.generate(prompt, params)
        layers = engine.runner.decoder.compiled
        assert sorted(layers._fns) == kept and sorted(layers.load_seconds) == [0, 1] and not layers.compile_seconds
        assert engine.runner.compiled is bool(kept) and result.stats["compiled_layers"] is bool(kept)
        assert (layers.calls > 0) is bool(kept)
        ar = Engine(later, EngineConfig(drafters=())).generate(prompt, params)  # its rows: one a forward
        calls = layers.calls
        for i in (0, 9, 23):  # the near-tie check's replay of AR runs the layers AR ran, so AR's choice is its argmax
            assert int(ar_scores(later, prompt, ar.token_ids[:i], params, compiled=ar.stats["compiled_layers"])
                       .argmax()) == ar.token_ids[i]
        assert (layers.calls > calls) is bool(kept)
    monkeypatch.setattr(aot_package, "load", lambda *a: pytest.fail("a dropped package was loaded again"))
    engine.expect(COMPILE_LAYERS_TOKENS)
    assert engine.generate(prompt, params).token_ids and not engine.runner.compiled
