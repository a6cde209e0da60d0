"""The one-call decoder layers (cpu_layers.py): the torch path's values, each row alone, taken only where they apply."""

import pytest
import torch

from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.cpu_layers import CpuLayers
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.paged_runner import PagedRunner
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.params import SamplingParams
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")


def _tiny(tmp_path, arch="llama", dtype="bfloat16"):
    # head size 32 (the kernels' attention takes multiples of 32), GQA 4/2, peaked outputs
    path = build_tiny_model(tmp_path / arch, arch=arch, hidden=128, heads=4, kv_heads=2, layers=3, seed=5,
                            initializer_range=0.3)
    lm = load_model(str(path), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in lm.model.model.layers:  # random norm weights (HF starts them at 1: a swapped norm would go unseen)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.data.copy_(1 + 0.3 * torch.randn(norm.weight.shape, generator=gen))
            norm.variance_epsilon = 1e-2  # large enough that a wrong eps shows at the percent level
    return lm


def _tree_forward(runner: ModelRunner, prompt: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor):
    """Prefill prompt, then one forward of tokens under mask (a tree: depth = ancestors - 1). -> hidden, new K, old K"""
    runner.reset(128)
    runner.prefill(prompt, 8)  # chunks of 8: the prefill runs the layers with masks too
    depth = mask.sum(1) - 1
    hidden = runner.forward(tokens, depth + prompt.shape[0], mask)
    k = runner.cache.k[:, :, : prompt.shape[0] + tokens.shape[0]].clone()
    return hidden, k


_TREE = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                     dtype=torch.bool)  # root, two children, a grandchild under each


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k, v
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_call_matches_the_torch_ops(tmp_path, arch, dtype):
    """Same roundings as decoder.py's torch ops; only the norm's sum of squares and SiLU's exp may differ (a last bit,
    which float32 carries into later values)."""
    lm = _tiny(tmp_path, arch, dtype)
    runner = ModelRunner(lm, max_rows=16)
    layers = runner.decoder.cpu_layers
    assert layers is not None
    prompt = torch.tensor([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10])
    tokens = torch.tensor([65, 66, 67, 68, 69])
    ours = _tree_forward(runner, prompt, tokens, _TREE)
    runner.decoder.cpu_layers = None
    try:
        theirs = _tree_forward(runner, prompt, tokens, _TREE)
    finally:
        runner.decoder.cpu_layers = layers
    for a, b in zip(ours, theirs):
        diff = (a.float() - b.float()).abs()
        close = 0.02 if dtype == "bfloat16" else 1e-5  # a wrong mask, rotary or residual moves values far more
        assert diff.max() <= close * b.float().abs().max()
        if dtype == "bfloat16":  # float32 carries a norm's last-bit difference into every later value
            assert (a != b).float().mean() < 0.1


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_row_is_the_same_alone_or_in_a_tree(tmp_path, dtype):
    """Each row computed alone: the tree's root-to-leaf rows equal the same tokens run one by one (AR steps)."""
    lm = _tiny(tmp_path, dtype=dtype)
    assert FusedDecoder.of(lm.model).cpu_layers is not None
    runner = ModelRunner(lm, max_rows=16)
    prompt = torch.tensor([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10])
    tokens = torch.tensor([65, 66, 67, 68, 69])
    hidden, k = _tree_forward(runner, prompt, tokens, _TREE)
    P = prompt.shape[0]
    for path in ([0, 1, 3], [0, 2, 4]):
        runner.reset(128)
        runner.prefill(prompt, 8)
        for depth, node in enumerate(path):
            h = runner.forward(tokens[node : node + 1], torch.tensor([P + depth]), torch.ones(1, 1, dtype=torch.bool))
            assert torch.equal(h[0], hidden[node])
            assert torch.equal(runner.cache.k[:, :, P + depth], k[:, :, P + node])
            runner.cache.append(1)


@needs_kernels
@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_drafting_equals_ar_through_the_one_call_layers(tmp_path, monkeypatch, sampled, dtype):
    lm = _tiny(tmp_path, dtype=dtype)
    calls = []
    real = CpuLayers.__call__
    monkeypatch.setattr(CpuLayers, "__call__", lambda self, *a, **kw: calls.append(a[0].shape[0]) or real(self, *a, **kw))
    prompt = list(b"abcabcabcabc the lighthouse keeper ")
    params = SamplingParams(max_tokens=60, temperature=1.0 if sampled else 0.0, seed=3, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    spec = Engine(lm, EngineConfig(trie_budget=12, adaptive_budget=False))
    assert spec.generate(prompt, params).token_ids == ar
    assert spec.generate(prompt, params, resume_from=ar[:25]).token_ids == ar
    assert 1 in calls and max(calls) > 1  # AR steps and wider verifies both went through it


@needs_kernels
def test_taken_only_where_it_computes_the_same(tmp_path):
    assert FusedDecoder.of(_tiny(tmp_path).model).cpu_layers is not None
    assert FusedDecoder.of(_tiny(tmp_path, dtype="float32").model).cpu_layers is not None
    assert FusedDecoder.of(_tiny(tmp_path, dtype="float64").model).cpu_layers is None  # float64: torch's path
    assert FusedDecoder.of(_tiny(tmp_path, arch="qwen3").model).cpu_layers is None  # per-head q/k norms
    lm = _tiny(tmp_path)
    lm.model.config.hidden_act = "gelu"  # the activation module decides, not the config
    from transformers.activations import ACT2FN

    for layer in lm.model.model.layers:
        layer.mlp.act_fn = ACT2FN["gelu"]
    assert FusedDecoder(lm.model).cpu_layers is None
    assert CpuLayers.of(FusedDecoder.of(_tiny(tmp_path).model), None) is None  # no kernels here


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("threads", [1, 3])  # 3: more threads than a sequence's blocks (a part of scratch each)
def test_a_batched_forward_gives_each_row_its_solo_values(tmp_path, dtype, threads, request):
    """Three sequences of different lengths and tries (other tree masks, one single row) in one batched forward: every
    row's hidden state, the K/V it leaves in its page and its kept queries equal its sequence's solo forward exactly."""
    request.addfinalizer(lambda n=torch.get_num_threads(): torch.set_num_threads(n))
    torch.set_num_threads(threads)
    lm = _tiny(tmp_path, dtype=dtype)
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    prompts = [torch.arange(10, 23), torch.arange(40, 45), torch.arange(60, 80)]
    news = [(torch.tensor([1, 2, 3]), _TREE[:3, :3]), (torch.tensor([4]), torch.ones(1, 1, dtype=torch.bool)),
            (torch.tensor([7, 8, 9]), chain)]
    runner = PagedRunner(lm, 3 * 64, page_size=64, backend="dense")
    seqs = [runner.pool.admit(64) for _ in prompts]
    for sp, p in zip(seqs, prompts):
        runner.prefill(sp, p, 8)
    positions = [m.sum(1) - 1 + p.shape[0] for p, (_, m) in zip(prompts, news)]
    hidden = runner.forward(seqs, [t for t, _ in news], positions, [m for _, m in news], capture_queries=True)
    row = 0
    for sp, p, (t, m), pos in zip(seqs, prompts, news, positions):
        solo = ModelRunner(lm, max_rows=16)
        solo.reset(64)
        solo.prefill(p, 8)
        rows = slice(row, row + t.shape[0])
        assert torch.equal(solo.forward(t, pos, m, capture_queries=True), hidden[rows])
        n = p.shape[0] + t.shape[0]
        page = int(sp.table(n)[0])
        assert torch.equal(solo.cache.k[:, :, :n], runner.pool.k[:, page, :, :n])
        assert torch.equal(solo.cache.v[:, :, :n], runner.pool.v[:, page, :, :n])
        assert all(torch.equal(a.transpose(0, 1), b[rows]) for a, b in zip(solo.queries, runner.queries))
        row += t.shape[0]


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["dense", "sdpa"])
def test_a_batched_worker_runs_each_sequence_as_its_solo_run(tmp_path, dtype, backend, monkeypatch):
    """A batched worker's sequences, each on its one page (as CPU jobs hold them), run the layers in one call too, each
    row as its solo run computes it: bf16 tokens equal solo AR's bit for bit as float32's do, drafted, with prefill
    chunks, tries of several rows and sequences arriving mid-run."""
    lm = _tiny(tmp_path, dtype=dtype)
    calls = []
    batch = CpuLayers.batch
    monkeypatch.setattr(CpuLayers, "batch", lambda self, *a, **k: calls.append(len(a[5])) or batch(self, *a, **k))
    text = list(b"the keeper climbed the stairs. the keeper climbed the stairs. the keeper")
    jobs = [("greedy", text, SamplingParams(max_tokens=60, ignore_eos=True)),
            ("sampled", list(b"once upon a time"), SamplingParams(max_tokens=50, temperature=1.0, min_p=0.1,
                                                                 penalty=1.2, penalty_window=16, seed=3,
                                                                 ignore_eos=True)),
            ("hot", list(b"abcabc"), SamplingParams(max_tokens=40, temperature=1.3, seed=1, ignore_eos=True))]
    refs = {key: Engine(lm, EngineConfig(drafters=())).generate(p, params).token_ids for key, p, params in jobs}
    need = len(text) + 60 + 16 + 1
    engine = Engine(lm, EngineConfig(drafters=("ngram", "recycling"), adaptive_budget=False, trie_budget=16,
                                          prefill_chunk=8),
                         BatchConfig(concurrency=2, kv_tokens=2 * need, page_size=need, backend=backend))
    got = engine.run([(key, p, params, []) for key, p, params in jobs])
    assert {key: r.token_ids for key, r in got.items()} == refs
    assert got["greedy"].stats["mean_accepted"] > 1.05  # drafted tokens were accepted (and moved into place)
    assert max(calls) == 2  # two sequences in one call


@needs_kernels
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kept_queries_change_nothing_and_drafting_with_heads_equals_ar(tmp_path, dtype):
    """A verify that keeps its queries (the self-drafter's KV importance) runs the one call too: the same hidden states
    as without them, the torch path's queries up to the layers' rounding, and heads drafting equal to AR."""
    from specrun.decoding.drafters.heads import DraftHeads

    lm = _tiny(tmp_path, dtype=dtype)
    runner = ModelRunner(lm, max_rows=16)
    prompt = torch.tensor([72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10])
    tokens, positions = torch.tensor([65, 66, 67]), torch.tensor([13, 14, 15])
    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    outs = {}
    for keep in (False, True):
        runner.reset(64)
        runner.prefill(prompt, 8)
        outs[keep] = runner.forward(tokens, positions, chain, capture_queries=keep)
    assert torch.equal(outs[True], outs[False])
    ours = runner.queries
    layers, runner.decoder.cpu_layers = runner.decoder.cpu_layers, None
    try:
        runner.reset(64)
        runner.prefill(prompt, 8)
        runner.forward(tokens, positions, chain, capture_queries=True)
    finally:
        runner.decoder.cpu_layers = layers
    close = 0.02 if dtype == "bfloat16" else 1e-5
    assert len(ours) == len(runner.queries) == 3
    for a, b in zip(ours, runner.queries):
        assert a.shape == b.shape == (4, 3, 32) and (a.float() - b.float()).abs().max() <= close * b.float().abs().max()
    heads = DraftHeads(lm.model.config.hidden_size, 3).to(lm.dtype)
    g = torch.Generator().manual_seed(0)
    for lin in heads.linears:  # heads that disagree with l_0, so their drafts are partly rejected
        lin.weight.data.copy_(0.5 * torch.randn(lin.weight.shape, generator=g))
    prompt_ids = list(b"abcabcabcabc the lighthouse keeper ")
    params = SamplingParams(max_tokens=40, seed=3, ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt_ids, params).token_ids
    drafted = Engine(lm, EngineConfig(drafters=("heads",), kv_mode="dynamic", kv_budget=24, trie_budget=12,
                                      adaptive_budget=False), heads=heads).generate(prompt_ids, params)
    assert drafted.token_ids == ar and drafted.stats["tokens_by_drafter"].get("heads", 0) > 0
