"""The compiled self-draft (--compile): the torch draft's logits over its bf16 ring as the window slides and drafts
are committed, and an engine drafting through it emits AR's tokens."""

import shutil

import pytest
import torch

from specrun.decoding.drafters import quant_ring, quant_torch, ring_graph
from specrun.decoding.drafters.quant_ring import RingForward
from specrun.decoding.drafters.quant_torch import TorchForward
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.runner import ModelRunner
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model
from tests.decoding.test_quant_draft import PROMPT, SAMPLED, _model, _on_grid


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """test_quant_draft's tiny model at 2 layers: each compile of this module's graphs costs less (a layer's products,
    rendered and built each time), and layers still follow layers."""
    return build_tiny_model(tmp_path_factory.mktemp("quant") / "llama", hidden=128, heads=4, kv_heads=2, layers=2,
                            seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def smooth_dir(tmp_path_factory):
    """test_quant_draft's tiny model with weights of a trained model's size: a flipped bf16 rounding stays small."""
    return build_tiny_model(tmp_path_factory.mktemp("ring") / "llama", hidden=128, heads=4, kv_heads=2, layers=2,
                            seed=5, initializer_range=0.05)


pytestmark = [pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="inductor compiles C++: no compiler here"),
              pytest.mark.usefixtures("build_once")]  # several tests start from an empty cache: one build a graph


def _near(logits: torch.Tensor, ids: torch.Tensor, want: torch.Tensor, where) -> None:
    """A compiled draft's candidates (logits [C] at token ids [C], ascending) against the torch draft's logits [V]: its
    8 best tokens among them, and their logits the same within 2% of the largest (the same arithmetic but for the order
    of float32 sums and, compiled, where bf16 intermediates are rounded)."""
    assert ids.shape == (ring_graph.CANDIDATES,) and torch.equal(ids, ids.sort().values), where
    assert set(want.topk(8).indices.tolist()) <= set(ids.tolist()), where
    kept = logits > float("-inf")
    assert torch.equal(kept, want[ids] > float("-inf")), where
    assert (logits[kept] - want[ids][kept]).abs().max() <= 0.02 * want.abs().max(), where


@pytest.mark.parametrize("compiled,window,first,bits", [(False, 5, 512, 4), (False, 12, 4, 4), (True, 12, 4, 4),
                                                         (True, 12, 4, 8)],
                         ids=["window 5", "window 12, the ring growing", "compiled, the ring growing",
                              "compiled in 8 bits (an AVX2 CPU's), the ring growing"])
def test_the_ring_holds_what_the_torch_draft_attends_and_drafts_as_it_does(smooth_dir, monkeypatch, compiled, window,
                                                                           first, bits):
    """2 sinks and a short window over a 13-token prompt: four drafts of 3 tokens, 2 of each committed (the target's own
    K/V replace the drafted ones), the ring starting at `first` slots past the sinks. Each drafted token attends
    exactly the sinks and the window's positions before it, each committed one holding the target's K/V (in bf16);
    its candidates' logits are the torch draft's over the target's cache so rounded (_near). Blocks of 4 slots: the ring
    grows through several whole blocks."""
    monkeypatch.setattr(ring_graph, "BLOCK", 4)
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", window)
    monkeypatch.setattr(quant_ring, "SPAN_STEP", first)
    lm = _on_grid(load_model(str(smooth_dir), dtype="float32"))
    runner = ModelRunner(lm, max_rows=16)
    runner.reset(64)
    runner.prefill(torch.tensor(PROMPT), 8)
    fwd = TorchForward(runner.decoder, bits)
    ring = RingForward(fwd)
    if compiled:
        ring.warm()  # the ring grows from 6 slots to 22 below: one package for every length
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
            seen = ring.pos[0, ring.visible(0, n + i)].sort().values.tolist()
            assert seen == [*range(2), *range(max(2, n + i + 1 - window), n + i)], (step, i)
            committed = torch.tensor([p for p in seen if p < n])
            slots = ring.slot(committed)
            k, v = ring.kv(0)
            assert torch.equal(k[:, :, slots].float(), runner.cache.k[:, :, committed])
            assert torch.equal(v[:, :, slots].float(), runner.cache.v[:, :, committed])
            got.append(ring.candidates(i, [t], *every))
        fwd.begin([runner.cache], [n], 3)
        want = [fwd.logits(i, [t], *every)[0] for i, t in enumerate(tokens)]
        for i, ((logits, ids), w) in enumerate(zip(got, want)):
            _near(logits[0], ids[0], w, (step, i))
        runner.forward(torch.tensor(tokens), torch.arange(n, n + 3), torch.ones((3, 3), dtype=torch.bool).tril_())
        runner.cache.commit(torch.tensor([0, 1]))
    assert ring.calls == 12 and runner.cache.length == len(PROMPT) + 8
    need = len(PROMPT) + 6 + 3 - 2  # the last draft's positions past the sinks: grown in steps to them, or to the whole
    assert ring.span == min(window + quant_ring.RESERVE, -(-need // first) * first)  # window and its reserve
    assert ring.k.shape[3] * 4 == ring.v.shape[-1] == -(-(2 + ring.span) // 4) * 4  # whole blocks


@pytest.mark.parametrize("cpu,bits", [("AVX2", 8), ("AVX512", 4), ("DEFAULT", 4)])
def test_an_engines_compiled_draft_runs_8_bit_layers_on_an_avx2_cpu(smooth_dir, monkeypatch, cpu, bits):
    """On an AVX2 CPU (torch's int4 product compute-bound there) the compiled draft of a model on a 4-bit grid runs its
    layers in 8 bits through inductor's int8 GEMM template (weights frozen, autotuned); elsewhere in the draft's own 4."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu)
    fwd = TorchForward.of(FusedDecoder.of(_on_grid(load_model(str(smooth_dir), dtype="float32")).model))
    assert fwd.bits == 4
    copies = []
    monkeypatch.setattr(quant_ring, "TorchForward", lambda *a: copies.append(a) or TorchForward(*a))
    ring = quant_ring.ring_of(fwd)
    assert not ring.cached(batched=True) and not copies  # naming its packages makes no copy of the model
    assert ring.bits == bits and ring.fwd is fwd
    assert all(isinstance(L.down, quant_torch.Int8Linear if bits == 8 else quant_torch.Int4Linear)
               for L in ring.graph.layers)
    assert len(copies) == (bits == 8) and ring.graph.options.get("max_autotune", False) == (bits == 8)


def test_the_graph_chooses_the_candidates_the_eager_rule_keeps(smooth_dir):
    """The graph's rescoring (no compile needed to run it) against quant_torch.rescore on the same coarse logits: rows
    penalised or not, each keeping the tokens within its own margin of its penalised best, by token id, the model's
    head rows scoring them (within bf16 rounding); a row keeping more than CANDIDATES keeps its CANDIDATES best."""
    lm = _on_grid(load_model(str(smooth_dir), dtype="float32"))
    fwd = TorchForward.of(FusedDecoder.of(lm.model))
    graph = ring_graph.Graph(fwd)
    gen = torch.Generator().manual_seed(4)
    B, (V, H) = 4, fwd.rows.shape
    h = (torch.randn((B, H), generator=gen) * 3).bfloat16()
    coarse = fwd.head(h).float()  # [B, V]
    counts = [(torch.rand(V, generator=gen) < 0.3).to(torch.int32) for _ in range(B)]
    for b in range(B):  # each row's best counted: its penalty moves what it keeps
        counts[b][coarse[b].topk(4).indices] = 1
    counts[1] = None
    thetas, belows = [1.5, 1.0, 0.8, 1.5], [1.6, 3.3, 2.6, 1e9]
    want = quant_torch.rescore(coarse, counts, h, fwd.rows, thetas, belows)  # [B, V]
    table = torch.stack([torch.zeros(V, dtype=torch.int32) if c is None else c for c in counts])
    logits, ids = graph.rescore(h, coarse, table, torch.tensor(thetas)[:, None], torch.tensor(belows)[:, None],
                                fwd.rows)
    assert torch.equal(ids, ids.sort(dim=-1).values)
    for b in range(3):
        kept = (want[b] > float("-inf")).nonzero()[:, 0]
        assert 1 < len(kept) < ring_graph.CANDIDATES, b  # a margin that keeps some, not all
        assert torch.equal(ids[b][logits[b] > float("-inf")], kept), b
        assert torch.allclose(logits[b][logits[b] > float("-inf")], want[b, kept], rtol=2 ** -7, atol=1e-3), b
    c = torch.where(counts[3] > 0, torch.where(coarse[3] > 0, coarse[3] / 1.5, coarse[3] * 1.5), coarse[3])
    assert torch.equal(ids[3], c.topk(ring_graph.CANDIDATES).indices.sort().values) and (logits[3] > -1e30).all()


@pytest.fixture(scope="module")
def fresh_cache(tmp_path_factory):
    """A cache without the packages of this module's other tests, for the two compile_draft auto tests (the solo one
    builds the one-sequence package the batched one then finds)."""
    return tmp_path_factory.mktemp("fresh-cache")


@pytest.fixture(scope="module")
def compiled_lm(model_dir, own_cache):
    """One model for the engine tests below: its layers and draft graph compile once, each test adding what it needs."""
    return _model(model_dir, "torch", "float32")


def test_an_engine_with_compile_drafts_through_the_compiled_graph_and_emits_ar(compiled_lm, monkeypatch):
    """--compile: one sequence's 4-bit chains come from the compiled graph (compiled when the engine starts, never
    during a generation), and its output is AR's."""
    lm = compiled_lm
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, SAMPLED).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_layers="on"))
    ring = engine.quant
    assert isinstance(ring, RingForward) and ring.fn is not None
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    result = engine.generate(PROMPT, SAMPLED)
    assert result.token_ids == ar
    assert ring.calls > 0 and result.stats["mean_accepted"] > 3.0, result.stats


def test_several_sequences_draft_each_in_its_own_ring_and_a_finished_ones_ring_is_freed(smooth_dir, monkeypatch):
    """Two sequences of different lengths drafted through one compiled call a depth, each ring keyed by its owner:
    each one's candidates are the torch draft's over its own cache (_near). Once an owner is gone its ring is freed
    and the other moves into its place; a new owner gets a ring of its own; with every owner gone the rings start at
    their first size again; one package for one sequence and one for several, for every ring length."""
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", 12)
    monkeypatch.setattr(quant_ring, "SPAN_STEP", 4)
    lm = _on_grid(load_model(str(smooth_dir), dtype="float32"))
    runners = []
    for prompt in (PROMPT, PROMPT[3:9]):
        runner = ModelRunner(lm, max_rows=16)
        runner.reset(64)
        runner.prefill(torch.tensor(prompt), 8)
        for kv in (runner.cache.k, runner.cache.v):  # the values the ring holds
            kv.copy_(kv.bfloat16().float())
        runners.append(runner)
    fwd = TorchForward.of(runners[0].decoder)
    ring = RingForward(fwd)
    ring.warm(batched=True)
    every = ([None], [1.0], [1e9])  # every token a candidate

    class Owner:
        pass

    def draft(owners, rs, tokens):
        caches, n = [r.cache for r in rs], [r.cache.length for r in rs]
        ring.begin(caches, n, 3, owners)
        got = [ring.candidates(i, [t] * len(rs), *(e * len(rs) for e in every)) for i, t in enumerate(tokens)]
        for b, r in enumerate(rs):  # each alone through the torch draft over its own cache
            fwd.begin([r.cache], [n[b]], 3)
            for i, t in enumerate(tokens):
                _near(got[i][0][b], got[i][1][b], fwd.logits(i, [t], *every)[0], (b, i))

    a, b = Owner(), Owner()
    draft([a, b], runners, [65, 70, 75])
    assert len(ring.owners) == 2 and ring.whole
    draft([b, a], runners[::-1], [66, 71, 76])  # the other order: each still in its own ring
    assert not ring.whole
    del a  # its sequence finished
    draft([b], runners[1:], [67, 72, 77])
    assert len(ring.owners) == 1 and ring.owners[0]() is b and ring.k.shape[0] == 1
    c = Owner()
    draft([b, c], runners[::-1], [68, 73, 78])  # a new sequence over the first cache: a ring of its own, synced
    assert len(ring.owners) == 2 and ring.calls == 3 * (2 + 2 + 1 + 2)
    assert ring.span > quant_ring.SPAN_STEP  # grown to the longer cache
    del b, c  # every sequence finished: the next one starts in one ring of the first size
    draft([Owner()], runners[1:], [69, 74, 79])
    assert len(ring.owners) == 1 and ring.span == 2 * quant_ring.SPAN_STEP  # grown again only to its own 3 + 6 + 3
    # each package's candidates with penalties and margins of its rows' own: the eager graph's on the same inputs
    gen = torch.Generator().manual_seed(6)
    for B in (1, 3):
        x, cos, sin, K, V, mask, _, _, _, head = ring._example(B)
        x, K, V = (torch.randn(t.shape, generator=gen).bfloat16() for t in (x, K, V))
        counts = (torch.rand((B, head.shape[0]), generator=gen) < 0.3).to(torch.int32)
        theta, below = torch.tensor([[1.5], [1.0], [0.7]])[:B], torch.tensor([[1.0], [2.0], [0.5]])[:B]
        args = (x, cos, sin, K, V, mask, counts, theta, below)
        (got, got_ids, _, _), (want, want_ids, _, _) = ring._call(args, head), ring.graph(*args, head)
        ours, theirs = ({(r, int(t)): float(v) for r in range(B) for t, v in zip(i[r], lg[r]) if v > float("-inf")}
                        for lg, i in ((got, got_ids), (want, want_ids)))
        assert 0 < len(theirs) < want.numel(), B  # margins that keep some, not all
        both = ours.keys() & theirs.keys()  # the same candidates but a rounding at a margin's edge
        assert len(both) >= 0.9 * max(len(ours), len(theirs)), (B, len(both), len(ours), len(theirs))
        assert all(abs(ours[k] - theirs[k]) <= 0.02 * (1 + abs(theirs[k])) for k in both), B


def test_a_batched_engine_with_compile_drafts_every_sequence_through_the_compiled_graph(compiled_lm, monkeypatch):
    """--compile with several prompts on a worker: the engine's 4-bit chains come from the compiled graph, one
    call a depth for all, each sequence in its own ring; every output is its solo AR run's."""
    from specrun.decoding.engine import BatchConfig, Engine

    lm = compiled_lm
    prompts = [PROMPT, PROMPT[:5] + [50, 60, 70], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    ar = [Engine(lm, EngineConfig(drafters=())).generate(p, SAMPLED).token_ids for p in prompts]
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False,
                                          compile_layers="on"),
                         BatchConfig(concurrency=3, kv_tokens=3 * 256, page_size=256))
    ring = engine.quant
    assert isinstance(ring, RingForward) and ring.batched
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    got = engine.run([(i, p, SAMPLED, []) for i, p in enumerate(prompts)])
    for i in range(3):
        assert got[i].token_ids == ar[i], i
        assert got[i].stats["mean_accepted"] > 3.0, got[i].stats
    assert ring.calls >= 3 * 3 * (SAMPLED.max_tokens // 4) // 2  # most steps drafted every sequence through it


def test_the_full_ring_stays_within_one_compiled_graph():
    """Sinks, window and a chain's reserve fill at most 4,096 slots, the keys the package is built for: past 4,096 keys
    inductor's C++ reductions take another accumulation (under torch.compile a second graph compiled in the middle of a
    run, ~40 s on smollm2, and ran slower)."""
    assert quant_torch.SINKS + quant_torch.WINDOW + quant_ring.RESERVE <= 4096


def test_compile_draft_auto_compiles_the_draft_once_an_engines_generations_ask_for_enough_tokens(model_dir,
                                                                                                   monkeypatch,
                                                                                                   fresh_cache):
    """compile_draft auto (the default), nothing cached: an engine drafts through torch's eager draft until its
    generations have asked for COMPILE_DRAFT_TOKENS new tokens in all (a resumed one counts what is left of it), then
    through the compiled graph, every generation emitting AR's tokens; off never compiles it, on always. Once its
    package is cached, another process's engine (here: the model loaded anew) takes it at once for a short text,
    loading it, not building it."""
    from specrun.decoding import config as engine_config

    monkeypatch.setenv("SPECRUN_CACHE", str(fresh_cache))  # no package of the module's earlier tests
    lm = _model(model_dir, "torch", "float32")
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, SAMPLED).token_ids
    monkeypatch.setattr(engine_config, "COMPILE_DRAFT_TOKENS", 2 * SAMPLED.max_tokens)
    compiles = _spy_compiles(monkeypatch)
    quant = {"drafters": ("quant",), "trie_budget": 4, "adaptive_budget": False}
    engine = Engine(lm, EngineConfig(**quant))
    eager = engine.quant
    assert isinstance(eager, TorchForward)
    assert engine.generate(PROMPT, SAMPLED, resume_from=ar[:100]).token_ids == ar  # 20 tokens asked
    assert engine.generate(PROMPT, SAMPLED).token_ids == ar  # 140 in all
    assert engine.quant is eager and compiles == []

    result = engine.generate(PROMPT, SAMPLED)  # 260: past the mark
    ring = engine.quant
    assert isinstance(ring, RingForward) and ring.fn is not None and compiles == [False] and ring.built == 1
    assert result.token_ids == ar and ring.calls > 0 and result.stats["mean_accepted"] > 3.0, result.stats
    calls = ring.calls

    off = Engine(lm, EngineConfig(**quant, compile_draft="off"))
    for _ in range(3):
        assert off.generate(PROMPT, SAMPLED).token_ids == ar
    assert off.quant is eager and ring.calls == calls and compiles == [False]
    on = Engine(lm, EngineConfig(**quant, compile_draft="on"))
    assert on.generate(PROMPT, SAMPLED).token_ids == ar and on.quant is ring and ring.calls > calls

    again = Engine(_model(model_dir, "torch", "float32"), EngineConfig(**quant))  # a new decoder: nothing loaded
    assert again.quant is not eager and isinstance(again.quant, TorchForward)
    result = again.generate(PROMPT, SAMPLED, resume_from=ar[:100])  # 20 tokens asked: the cached package
    loaded = again.quant
    assert isinstance(loaded, RingForward) and loaded.built == 0 and loaded.calls > 0 and compiles[-1] is False
    assert result.token_ids == ar


def _spy_compiles(monkeypatch) -> list[bool]:
    """The `batched` of every call of quant_ring.ring_forward through compiled_draft, which still runs it."""
    from specrun.decoding.drafters import quant_draft

    seen, real = [], quant_draft.ring_forward

    def spy(forward, batched=False):
        seen.append(batched)
        return real(forward, batched)

    monkeypatch.setattr(quant_draft, "ring_forward", spy)
    return seen


def test_a_batched_engine_compiles_the_draft_once_its_sequences_ask_for_enough_tokens(model_dir,
                                                                                     monkeypatch, fresh_cache):
    """An engine of several sequences: compile_draft auto, its several-sequences package not cached: its eager draft
    until the sequences it admitted ask for COMPILE_DRAFT_TOKENS new tokens in all, then the compiled graph for every
    sequence; outputs their solo AR runs'."""
    from specrun.decoding import config as engine_config
    from specrun.decoding.engine import BatchConfig, Engine

    monkeypatch.setenv("SPECRUN_CACHE", str(fresh_cache))  # no package of the module's earlier tests
    lm = _model(model_dir, "torch", "float32")
    solo_cached = quant_ring.ring_of(FusedDecoder.of(lm.model)._specrun_q4).cached()  # the test above built it
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    ar = [Engine(lm, EngineConfig(drafters=())).generate(p, SAMPLED).token_ids for p in prompts]
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False),
                    BatchConfig(concurrency=2, kv_tokens=2 * 256, page_size=256))
    monkeypatch.setattr(engine_config, "COMPILE_DRAFT_TOKENS", 2 * SAMPLED.max_tokens)
    compiles = _spy_compiles(monkeypatch)
    eager = engine.quant
    assert isinstance(eager, TorchForward)
    assert engine.admit(0, prompts[0], SAMPLED)
    assert engine.quant is eager and compiles == []  # 120 tokens asked: not worth a compile yet
    assert engine.admit(1, prompts[1], SAMPLED)  # 240
    ring = engine.quant
    assert isinstance(ring, RingForward) and ring.batched and compiles == [True] and ring.built == 2 - solo_cached
    got = engine.run([])  # the two admitted, to the end
    assert [got[i].token_ids for i in range(2)] == ar
    assert ring.calls >= 2 * 3 * (SAMPLED.max_tokens // 4) // 2  # both sequences drafted through it


def test_a_batched_engine_drafts_with_its_eager_draft_only_under_compile_draft_off(model_dir, tmp_path,
                                                                                  monkeypatch):
    """Several sequences a step, nothing cached and too few tokens asked for a compile: under compile_draft auto the
    quantized self-draft drafts nothing until its compiled graph is there (eager, its forward for every sequence cost
    more than it saved); off drafts eagerly. Outputs are AR's either way."""
    from specrun.decoding.engine import BatchConfig, Engine

    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    lm = _model(model_dir, "torch", "float32")
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    ar = [Engine(lm, EngineConfig(drafters=())).generate(p, SAMPLED).token_ids for p in prompts]
    drafted = {}
    for mode in ("auto", "off"):
        engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False,
                                         compile_draft=mode), BatchConfig(concurrency=2, kv_tokens=512, page_size=256))
        got = engine.run([(i, p, SAMPLED, []) for i, p in enumerate(prompts)])
        assert isinstance(engine.quant, TorchForward) and [got[i].token_ids for i in range(2)] == ar, mode
        drafted[mode] = [got[i].stats["tokens_by_drafter"]["quant"] for i in range(2)]
    assert drafted["auto"] == [0, 0] and min(drafted["off"]) > 0, drafted


def test_compile_draft_takes_auto_on_or_off():
    with pytest.raises(ValueError, match="compile_draft='sometimes'; choose from auto, on, off"):
        EngineConfig(compile_draft="sometimes")
