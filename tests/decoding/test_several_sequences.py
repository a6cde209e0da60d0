"""The engine with several sequences a step (and one: run(), steps()): paged pool, plan arrays, `paged` ==
`sdpa`, and per-sequence outputs equal solo runs."""

import numpy as np
import pytest
import torch

from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.dense_attention import attend_dense, dense_rows
from specrun.decoding.forward.paged_attention import attend_paged, attend_sdpa, resolve_backend, sdpa_spans
from specrun.decoding.forward.paged_kv import PagePool
from specrun.decoding.forward.plan import build_plan, packbits, unpackbits
from specrun.decoding.verify.params import SamplingParams
from tests.decoding.test_attention import CUDA

REPETITIVE = "the cat sat on the mat. the cat sat on the mat. the cat"


def random_tree_mask(T: int, gen: torch.Generator) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree (parents before children). # -> [T, T] bool"""
    m = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        m[i] |= m[int(torch.randint(0, i, (1,), generator=gen))]
    return m


def test_packbits_is_numpys_little_bit_order():
    bits = torch.rand(77, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = packbits(bits)
    assert packed.tolist() == np.packbits(bits.numpy(), bitorder="little").tolist()
    assert torch.equal(unpackbits(packed, 77), bits)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_equals_sdpa_on_random_ragged_tries(page_size):
    gen = torch.Generator().manual_seed(page_size)
    Hq, Hkv, D, layers = 6, 2, 8, 1
    pool = PagePool(layers, 400, page_size, Hkv, D, torch.float64, "cpu")
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    seqs, masks = [], []
    for committed, T in [(0, 5), (37, 1), (90, 17), (5, 9), (64, 1)]:  # ragged: fresh, AR rows, wide tries
        sp = pool.admit(committed + T + 8)
        sp.ensure(committed)
        sp.append(committed)
        seqs.append(sp)
        masks.append(torch.ones(T, T, dtype=torch.bool).tril() if committed == 0 else random_tree_mask(T, gen))
    plan = build_plan(seqs, masks)
    assert plan.kv_last_page_len.min() >= 1 and plan.kv_last_page_len.max() <= page_size
    assert plan.mask_indptr.tolist()[-1] == plan.mask_packed.shape[0]
    q = torch.randn(int(plan.qo_indptr[-1]), Hq, D, generator=gen, dtype=torch.float64)
    ref = attend_sdpa(sdpa_spans(plan, Hq // Hkv, q.device), pool.k[0], pool.v[0], q, None)
    got = attend_paged(plan, pool.k[0], pool.v[0], q, None)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dense_equals_sdpa_on_random_ragged_tries(dtype, monkeypatch):
    """Sequences on scattered pages (another sequence's page between them), one-row and trie-wide, attend in one call."""
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, D = 6, 2, 8
    pool = PagePool(1, 6, 200, Hkv, D, dtype, "cpu")
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    hole, outside = pool.admit(150), pool.admit(150)
    hole.ensure(1)
    outside.ensure(1)  # pages 0 and 1; page 1 stays another sequence's
    seqs, masks = [], []
    for committed, T in [(37, 1), (90, 17), (150, 1), (0, 5), (64, 9)]:
        sp = pool.admit(committed + T)
        sp.ensure(committed)
        sp.append(committed)
        seqs.append(sp)
        masks.append(torch.ones(T, T, dtype=torch.bool).tril() if committed == 0 else random_tree_mask(T, gen))
        if len(seqs) == 2:
            hole.release()  # page 0 goes to the next sequence: the forward's pages are 0, 2, 3, 4, 5
    plan = build_plan(seqs, masks, pack_mask=False)
    dense = dense_rows(plan, Hkv, Hq // Hkv, "cpu")
    assert dense.members == frozenset(range(5)) and dense.Pb == 6 and dense.T == 17
    q = torch.randn(int(plan.qo_indptr[-1]), Hq, D, generator=gen, dtype=dtype)
    ref = attend_sdpa(sdpa_spans(plan, Hq // Hkv, q.device), pool.k[0], pool.v[0], q, None)
    got = torch.full_like(q, float("nan"))
    attend_dense(dense, pool.k[0], pool.v[0], q, None, got)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    if dtype == torch.bfloat16:  # scores as sdpa takes them (float32): about sdpa's distance from float64, not 3-5x
        q = (q.float() * 6).to(dtype)  # scores of a sharp softmax, as a model's are, where a rounded score shows
        spans = sdpa_spans(plan, Hq // Hkv, q.device)
        exact = attend_sdpa(spans, pool.k[0].double(), pool.v[0].double(), q.double(), None)
        attend_dense(dense, pool.k[0], pool.v[0], q, None, got)
        ours, sdpas = ((x.double() - exact).abs().max().item() for x in (got, attend_sdpa(spans, pool.k[0], pool.v[0],
                                                                                           q, None)))
        assert ours <= 2 * sdpas, (ours, sdpas)
    assert dense_rows(build_plan(seqs[:1], masks[:1], pack_mask=False), Hkv, Hq // Hkv, "cpu") is None  # one: sdpa
    monkeypatch.setattr("specrun.decoding.forward.dense_attention.DENSE_MAX_SCORES", 6 * Hkv * 192 * 3 * 17 * 4 - 1)
    assert dense_rows(plan, Hkv, Hq // Hkv, "cpu") is None  # scores over the cap: the per-sequence path


def test_auto_backend_is_dense_only_on_cpu_in_reduced_precision():
    assert resolve_backend("auto", torch.bfloat16, "cpu") == "dense"
    assert resolve_backend("auto", torch.float32, "cpu") == "sdpa"
    assert resolve_backend("auto", torch.bfloat16, "cuda") == "sdpa"  # no head size given: not flashinfer's


def test_auto_backend_is_flashinfer_on_cuda_where_it_is_installed_and_fits(monkeypatch):
    from specrun.decoding.forward import paged_attention

    monkeypatch.setattr(paged_attention, "flashinfer_available", lambda: True)
    assert resolve_backend("auto", torch.bfloat16, "cuda", 128) == "flashinfer"
    assert resolve_backend("auto", torch.float32, "cuda", 128) == "sdpa"  # float32: solo runs bit for bit
    assert resolve_backend("auto", torch.bfloat16, "cuda", 80) == "sdpa"  # a head size its kernels are not built for
    assert resolve_backend("auto", torch.bfloat16, "cpu", 128) == "dense"
    monkeypatch.setattr(paged_attention, "flashinfer_available", lambda: False)
    assert resolve_backend("auto", torch.bfloat16, "cuda", 128) == "sdpa"
    assert resolve_backend("paged", torch.bfloat16, "cpu") == "paged"
    with pytest.raises(ValueError, match="'flash'"):
        resolve_backend("flash", torch.float32, "cpu")


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [1, 4])
def test_commit_keeps_accepted_rows_and_returns_pages(page_size, device):
    """The accepted path comes from the verify forward, on the model's device; the page table is on the CPU."""
    pool = PagePool(2, 64, page_size, 1, 2, torch.float32, device)
    before = pool.available
    sp = pool.admit(40)
    sp.ensure(10)
    sp.append(10)
    plan = build_plan([sp], [torch.eye(6, dtype=torch.bool)])
    marks = torch.arange(100, 106, dtype=torch.float32)
    pool.k[:, plan.write_pages, :, plan.write_offsets] = marks[:, None, None, None].expand(6, 2, 1, 2).to(device)
    sp.commit(torch.tensor([0, 2, 5], device=device))
    assert sp.length == 13
    pages, offsets = sp.slots(10, 13)
    assert pool.k[0, pages, 0, offsets, 0].tolist() == [100.0, 102.0, 105.0]
    assert sp.n_pages == pool.pages_for(13)
    sp.release()
    assert pool.available == before


def test_admission_reserves_the_whole_need():
    pool = PagePool(1, 10, 2, 1, 2, torch.float32, "cpu")
    a = pool.admit(12)  # 6 pages promised
    assert a is not None and pool.admit(9) is None  # 5 more do not fit in the 4 left
    b = pool.admit(8)
    assert b is not None and pool.available == 0
    a.release()
    assert pool.available == 6


def solo(lm, prompt, params, drafters, resume=()):
    return Engine(lm, EngineConfig(drafters=drafters)).generate(prompt, params, resume_from=list(resume))


# 256: one page per sequence (read in place, as on CPU jobs); dense: rounding-level differences leave float32 tokens;
# 16 on CUDA: the page size CUDA workers use
@pytest.mark.parametrize(("page_size", "backend", "device"), [
    (1, "sdpa", "cpu"), (256, "sdpa", "cpu"), (256, "dense", "cpu"),
    pytest.param(16, "sdpa", "cuda", marks=[pytest.mark.gpu, CUDA])])
def test_each_sequence_equals_its_solo_run_whatever_runs_beside_it(load_fixture, page_size, backend, device):
    lm = load_fixture("llama_gqa", dtype="float32", device=device)
    tok = lm.tokenizer
    drafters = ("ngram", "recycling")
    free = solo(lm, tok.encode(REPETITIVE), SamplingParams(max_tokens=80, ignore_eos=True), drafters).token_ids
    stop = free[next(i for i in range(20, 80) if free[i] not in free[:20])]  # a token it first writes part way
    mixed = [
        ("greedy", tok.encode(REPETITIVE), SamplingParams(max_tokens=60, ignore_eos=True)),
        ("sampled", tok.encode("once upon a time"), SamplingParams(max_tokens=45, temperature=0.9, seed=3, min_p=0.05,
                                                                   penalty=1.2, penalty_window=16, ignore_eos=True)),
        ("stop", tok.encode(REPETITIVE), SamplingParams(max_tokens=80, stop_token_ids=(stop,), ignore_eos=True)),
        ("short", tok.encode("abc"), SamplingParams(max_tokens=7, temperature=1.0, seed=9, top_k=20)),
        ("eos", tok.encode("hello there"), SamplingParams(max_tokens=50, temperature=1.3, seed=1)),
    ]
    refs = {key: solo(lm, p, params, drafters) for key, p, params in mixed}
    assert refs["stop"].finish_reason == "stop"
    for concurrency in (1, 2, 5):  # arrivals mid-run when fewer slots than requests
        engine = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False),  # every step drafts
                             BatchConfig(concurrency=concurrency, kv_tokens=5 * 256, page_size=page_size,
                                         backend=backend))
        got = engine.run([(key, p, params, []) for key, p, params in mixed])
        for key, _, _ in mixed:
            assert got[key].token_ids == refs[key].token_ids, (concurrency, key)
            assert got[key].finish_reason == refs[key].finish_reason, (concurrency, key)
        assert got["greedy"].stats["mean_accepted"] > 1.5  # drafts were accepted: the equality is not vacuous
    assert engine.runner.pool.available == engine.runner.pool.n_pages  # every page came back


def test_resumed_sequence_and_page_size_do_not_change_tokens(load_fixture):
    lm = load_fixture("qwen2", dtype="float32")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = SamplingParams(max_tokens=50, temperature=0.8, seed=5, ignore_eos=True)
    ref = solo(lm, prompt, params, ("ngram",)).token_ids
    engine = Engine(lm, EngineConfig(drafters=("ngram",)), BatchConfig(concurrency=2, page_size=4, kv_tokens=512))
    got = engine.run([("resumed", prompt, params, ref[:17]), ("fresh", prompt, params, [])])
    assert got["resumed"].token_ids == ref and got["fresh"].token_ids == ref


def test_plain_ar_batch_and_stop_callback(load_fixture):
    lm = load_fixture("llama_mha", dtype="float32")
    prompts = [lm.tokenizer.encode(t) for t in ("abc abc", "hello", "the cat sat")]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = Engine(lm, EngineConfig(drafters=()), BatchConfig(concurrency=3, kv_tokens=256))
    seen = {}

    def on_step(key, emitted):
        seen.setdefault(key, []).extend(emitted)
        return key == 1 and len(seen[key]) >= 5  # the caller stops request 1 early

    got = engine.run([(i, p, params, []) for i, p in enumerate(prompts)], on_step)
    for i, p in enumerate(prompts):
        ref = solo(lm, p, params, ()).token_ids
        assert got[i].token_ids == (ref[:5] if i == 1 else ref)
        assert seen[i] == got[i].token_ids
    assert got[1].finish_reason == "stopped"


def test_an_engine_of_one_sequence_runs_requests_in_turn_and_steps_needs_it_idle(load_fixture):
    """Concurrency 1: run() admits one request at a time into the one cache, each getting its generate() output (the
    cache emptied at each admission); steps() drives one sequence on an idle engine and refuses beside another."""
    lm = load_fixture("llama_mha", dtype="float32")
    prompts = [lm.tokenizer.encode(t) for t in (REPETITIVE, "hello", "the cat sat")]
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=2, ignore_eos=True)
    engine = Engine(lm, EngineConfig(drafters=("ngram",)))
    refs = [engine.generate(p, params).token_ids for p in prompts]
    got = engine.run([(i, p, params, []) for i, p in enumerate(prompts[::-1])])
    assert [got[i].token_ids for i in range(3)] == refs[::-1]
    assert engine.admit("x", prompts[0], params) and not engine.admit("y", prompts[1], params)  # its one slot
    with pytest.raises(RuntimeError, match="none in flight"):
        next(engine.steps(prompts[1], params))


def test_a_failed_or_abandoned_generation_leaves_the_engine_free(load_fixture):
    """A step that raises, an on_step that raises, a steps() generator dropped half way, a run() that raises: its
    sequences go, and the next generation on the engine runs as on a fresh one."""
    lm = load_fixture("llama_mha", dtype="float32")
    prompt = lm.tokenizer.encode(REPETITIVE)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine = Engine(lm, EngineConfig(drafters=("ngram",)))
    first = engine.generate(prompt, params)
    ref = first.token_ids
    assert first.stats["phase_seconds"]["trie"] > 0  # building the tries is a phase of its own, not the drafts'
    forward = engine.runner.forward

    def fails(*args, **kwargs):
        engine.runner.forward = forward
        raise RuntimeError("out of memory")

    engine.runner.forward = fails
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(prompt, params)
    assert not engine.active and engine.generate(prompt, params).token_ids == ref
    with pytest.raises(KeyError):
        engine.generate(prompt, params, on_step=lambda emitted: {}[0])
    assert not engine.active and engine.generate(prompt, params).token_ids == ref
    steps = engine.steps(prompt, params)
    next(steps)
    steps.close()
    assert not engine.active and engine.generate(prompt, params).token_ids == ref
    # run() (LLM.generate's path) likewise: a failed step or an interrupt in on_step drops what it admitted
    engine.runner.forward = fails
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.run([(0, prompt, params, []), (1, prompt, params, [])])
    assert not engine.active

    def interrupt(key, emitted):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        engine.run([(0, prompt, params, [])], on_step=interrupt)
    assert not engine.active and engine.generate(prompt, params).token_ids == ref
    assert engine.run([(0, prompt, params, []), (1, prompt, params, [])])[1].token_ids == ref


def test_pool_too_small_for_a_request_is_a_clear_error(load_fixture):
    lm = load_fixture("llama_mha", dtype="float32")
    engine = Engine(lm, EngineConfig(drafters=()), BatchConfig(concurrency=2, kv_tokens=32))
    with pytest.raises(ValueError, match="needs more KV slots"):
        engine.run([("big", [1, 2, 3], SamplingParams(max_tokens=100), [])])


@pytest.mark.gpu
@CUDA
def test_flashinfer_equals_paged_on_random_ragged_tries():
    pytest.importorskip("flashinfer", reason="needs flashinfer (pip install 'specrun[cuda]')")
    from specrun.decoding.forward.paged_attention import FlashInferAttention

    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, D = 8, 2, 128  # the head size of the GPU check's 8B shape: one JIT build of flashinfer serves both
    pool = PagePool(1, 512, 16, Hkv, D, torch.bfloat16, "cuda")
    pool.k.normal_()
    pool.v.normal_()
    seqs, masks = [], []
    for committed, T in [(100, 7), (300, 1), (33, 16)]:
        sp = pool.admit(committed + T)
        sp.ensure(committed)
        sp.append(committed)
        seqs.append(sp)
        masks.append(random_tree_mask(T, gen))
    plan = build_plan(seqs, masks)
    q = torch.randn(int(plan.qo_indptr[-1]), Hq, D, dtype=torch.bfloat16, device="cuda")
    fi = FlashInferAttention(torch.device("cuda"))
    fi.plan(plan, Hq, Hkv, D, torch.bfloat16, D**-0.5)
    got = fi.run(pool.k[0], pool.v[0], q)
    ref = attend_paged(plan, pool.k[0], pool.v[0], q, D**-0.5)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["full", "dynamic"])
@pytest.mark.parametrize("page_size", [1, 512])
def test_batched_heads_draft_as_the_solo_engine_does(load_fixture, mode, page_size):
    """Self-drafting (one draft forward for the batch, each sequence over its own partial cache) and fused heads:
    every sequence's tokens, and the drafts its heads made (tokens taken from them, steps, cache rebuilds), are
    those of its solo run."""
    from tests.decoding.test_self_draft import PROMPT, heads_for

    lm = load_fixture("qwen2", dtype="float32")
    heads = heads_for(lm, trained=False)  # zero heads: every l_i is l_0, right often enough on this text
    tok = lm.tokenizer
    requests = [("greedy", tok.encode(PROMPT), SamplingParams(max_tokens=70, ignore_eos=True)),
                ("sampled", tok.encode(REPETITIVE), SamplingParams(max_tokens=60, temperature=0.9, seed=4,
                                                                   penalty=1.2, penalty_window=16, ignore_eos=True)),
                ("short", tok.encode("the cat sat"), SamplingParams(max_tokens=30, ignore_eos=True))]
    for drafters in (("heads", "ngram"), ("fused", "ngram")):
        # a budget below the prompt lengths puts the partial caches to work from the first step
        cfg = EngineConfig(drafters=drafters, kv_mode=mode, kv_budget=24, kv_sinks=4, adaptive_budget=False)
        refs = {key: Engine(lm, cfg, heads=heads).generate(p, params) for key, p, params in requests}
        engine = Engine(lm, cfg, BatchConfig(concurrency=3, kv_tokens=3 * 512, page_size=page_size), heads=heads)
        got = engine.run(requests)
        for key, _, _ in requests:
            assert got[key].token_ids == refs[key].token_ids, (drafters, key)
            for stat in ("steps", "tokens_by_drafter", "kv_rebuilds"):
                assert got[key].stats[stat] == refs[key].stats[stat], (drafters, key, stat)
        assert got["greedy"].stats["tokens_by_drafter"][drafters[0]] > 0  # the heads' drafts were used
        if mode == "dynamic" and drafters[0] == "heads":
            assert got["greedy"].stats["kv_rebuilds"] > 1
