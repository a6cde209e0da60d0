"""The CUDA path against its CPU twins: the static (CUDA-graph) step against eager AR, the sampler on CUDA against the
CPU, the engine of several on flashinfer against one-sequence AR. Tests marked gpu skip without CUDA; the static step's
twin runs here."""

import pytest
import torch

from specrun.bench.neartie import check_divergence
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.static_step import MIN_BUCKET, bucket_of, chunk_size
from specrun.decoding.verify.sampling import SamplingParams, _bits, _key, gumbel_noise, process_logits, sample
from tests.decoding.test_attention import CUDA

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
GREEDY = SamplingParams(max_tokens=330, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=330, temperature=0.9, seed=3, min_p=0.05, penalty=1.2, penalty_window=32,
                         ignore_eos=True)


def test_buckets_double_from_the_smallest_and_stop_at_capacity():
    assert bucket_of(1, 10_000) == MIN_BUCKET and bucket_of(MIN_BUCKET, 10_000) == MIN_BUCKET
    assert bucket_of(MIN_BUCKET + 1, 10_000) == 2 * MIN_BUCKET
    assert bucket_of(9_000, 10_000) == 10_000 and bucket_of(100, 50) == 50
    assert chunk_size(65_536) == 1024 and chunk_size(65_536 + 256) == 256  # 64 chunks at least, dividing the bucket


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_static_step_generates_the_eager_tokens(load_fixture, device, params):
    """float32, a prompt that starts below the first bucket's end and a generation that crosses it: every width-1
    step is the static one (a CUDA graph per bucket on CUDA), and the tokens are eager AR's. A second, longer
    generation on the same engine grows the cache: the graphs of the old cache are not replayed."""
    lm = load_fixture("llama_gqa", dtype="float32", device=device)
    prompt = lm.tokenizer.encode("the cat sat on the mat. " * 8)  # ~190 tokens: the steps cross slot 256
    ref = Engine(lm, EngineConfig(drafters=(), step_graphs="off")).generate(prompt, params).token_ids
    engine = Engine(lm, EngineConfig(drafters=(), step_graphs="on"))
    assert engine.generate(prompt, params).token_ids == ref
    assert engine.runner.static.calls == params.max_tokens  # the prefill stops before the prompt's last token: each a step
    longer, first_cache = prompt * 2, engine.runner.cache
    ref2 = Engine(lm, EngineConfig(drafters=(), step_graphs="off")).generate(longer, params).token_ids
    assert engine.generate(longer, params).token_ids == ref2
    assert engine.runner.cache is not first_cache  # the cache grew: the static step took the new one
    if device == "cuda":
        assert engine.runner.static.graphs and len(engine.runner.static._captured) >= 2


@pytest.mark.parametrize("device", DEVICES)
def test_split_buckets_attend_as_one_pass(load_fixture, device, monkeypatch):
    """Every bucket split in chunks (split-KV, merged by log-sum-exp), sampled float32: the eager tokens."""
    from specrun.decoding.forward import static_step

    monkeypatch.setattr(static_step, "SPLIT_FROM", MIN_BUCKET)
    monkeypatch.setattr(static_step, "MIN_CHUNKS", 2)
    lm = load_fixture("llama_gqa", dtype="float32", device=device)
    prompt = lm.tokenizer.encode("the cat sat on the mat. " * 8)
    ref = Engine(lm, EngineConfig(drafters=(), step_graphs="off")).generate(prompt, SAMPLED).token_ids
    engine = Engine(lm, EngineConfig(drafters=(), step_graphs="on"))
    assert engine.generate(prompt, SAMPLED).token_ids == ref and engine.runner.static.calls == SAMPLED.max_tokens


def _cuda_like(chunks):
    """_chunks_lse answering as CUDA's efficient kernel does where a row sees no key of a chunk: lse 0, output 0."""

    def kernel(q, k, v, bias, scale):
        o, lse = chunks(q, k, v, bias, scale)
        blind = torch.isinf(bias).all(dim=-1).expand(lse.shape)  # [N, Hkv, M]
        return o.masked_fill(blind[..., None], 0.0), lse.masked_fill(blind, 0.0)

    return kernel


@pytest.mark.parametrize("kernel", ["own", "lse 0 for masked chunks"])
def test_split_bucket_hidden_state_is_the_eager_one(load_fixture, monkeypatch, kernel):
    """float64, slot 2,100 of a 4,096 bucket in 16 chunks of 256 (the last 7 see nothing): the static step's hidden
    state is the eager forward's to 1e-10, also where the chunk kernel returns lse 0 and output 0 for a blind chunk,
    as CUDA's efficient attention does (such chunks counting in the merge shrank the attention by a few %)."""
    from specrun.decoding.forward import static_step
    from specrun.decoding.forward.runner import ModelRunner

    if kernel != "own":
        monkeypatch.setattr(static_step, "_chunks_lse", _cuda_like(static_step._chunks_lse))
    lm = load_fixture("llama_gqa", dtype="float64")
    runner = ModelRunner(lm, max_rows=256)
    runner.reset(4096)
    runner.prefill(torch.randint(0, 200, (2100,), generator=torch.Generator().manual_seed(0)), 256)
    token, position = torch.tensor([7]), torch.tensor([2100])
    eager = runner.forward(token, position, torch.ones((1, 1), dtype=torch.bool))
    static = static_step.StaticStep(runner).forward(token, position)
    assert static_step.bucket_of(2101, runner.cache.capacity) == 4096 == static_step.SPLIT_FROM
    assert static_step.chunk_size(4096) == 256  # 16 chunks: 9 hold a committed slot or the new one
    assert (static - eager).abs().max() < 1e-10


def _random_trie(T: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree of T nodes (node 0 the root, each node's parent before it) -> ancestors [T, T] bool (self too)"""
    anc = torch.eye(T, dtype=torch.bool)
    for i in range(1, T):
        anc[i] |= anc[int(torch.randint(0, i, (1,), generator=gen))]
    return anc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", ["one pass", "split", "split, lse 0 for blind chunks"])
def test_static_trie_forward_is_the_runners(load_fixture, monkeypatch, device, split):
    """Tries of 1-70 rows padded to their row bucket, at slots whose bucket and chunks vary (tries across a chunk edge:
    rows that see no key of a chunk): the hidden states and the K/V written are the runner's (float64, to 1e-10); a
    trie of more rows than the largest bucket is the runner's."""
    from specrun.decoding.forward import static_step
    from specrun.decoding.forward.runner import ModelRunner

    if split != "one pass":
        monkeypatch.setattr(static_step, "SPLIT_FROM", MIN_BUCKET)
        monkeypatch.setattr(static_step, "MIN_CHUNKS", 2)  # chunks of 256 slots
    if split.endswith("blind chunks"):
        monkeypatch.setattr(static_step, "_chunks_lse", _cuda_like(static_step._chunks_lse))
    lm = load_fixture("llama_gqa", dtype="float64", device=device)
    gen = torch.Generator().manual_seed(1)
    runner = ModelRunner(lm, max_rows=256)
    runner.reset(1024)
    runner.prefill(torch.randint(0, 200, (300,), generator=gen).to(device), 64)
    static = static_step.StaticStep(runner)
    # (first slot, rows): across the edge at 256, on it, a trie of 40 in a bucket a trie of 64 filled before, 70 rows
    for start, T in ((1, 1), (250, 13), (240, 30), (256, 3), (200, 64), (230, 40), (255, 1), (100, 70)):
        runner.cache.length = start
        tokens = torch.randint(0, 200, (T,), generator=gen).to(device)
        tree = _random_trie(T, gen).to(device)
        positions = start + tree.sum(dim=1).to(device) - 1
        eager = runner.forward(tokens, positions, tree)
        k, v = (c[:, :, start : start + T].clone() for c in (runner.cache.k, runner.cache.v))
        runner.cache.k[:, :, start:] = 0
        runner.cache.v[:, :, start:] = 0
        hidden = static.forward(tokens, positions, tree)
        assert hidden.shape == eager.shape and (hidden - eager).abs().max() < 1e-10, (start, T)
        assert (runner.cache.k[:, :, start : start + T] - k).abs().max() < 1e-10, (start, T)
        assert (runner.cache.v[:, :, start : start + T] - v).abs().max() < 1e-10, (start, T)
        runner.prefill(torch.randint(0, 200, (300 - start,), generator=gen).to(device), 64)  # past start: K/V again
    assert static.calls == 7  # every trie but the one of 70 rows


def test_spec_steps_take_the_static_step(load_fixture):
    """n-gram and recycling drafting with the static step on: every verify forward is the static one, tries of
    several rows among them, and the tokens are AR's (float64)."""
    lm = load_fixture("llama_gqa", dtype="float64")
    prompt = lm.tokenizer.encode("once upon a time there was")
    ref = Engine(lm, EngineConfig(drafters=(), step_graphs="off")).generate(prompt, SAMPLED).token_ids
    engine = Engine(lm, EngineConfig(drafters=("ngram", "recycling"), step_graphs="on"))
    forwards = []
    inner = engine.runner.static.forward
    engine.runner.static.forward = lambda tokens, *a: forwards.append(tokens.shape[0]) or inner(tokens, *a)
    out = engine.generate(prompt, SAMPLED)
    assert out.token_ids == ref
    assert engine.runner.static.calls == len(forwards) == out.stats["steps"] and max(forwards) > 1


@pytest.mark.gpu
@CUDA
def test_sampler_on_cuda_is_the_cpu_sampler():
    """The same hash bits on both devices, noise within an ulp or two (the two libm's logs), the same tokens."""
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 2**31 - 1, (64,), generator=g)
    tokens = torch.randint(0, 200_000, (64,), generator=g)
    for seed in (0, 7, 2**63 - 1):
        key_cpu, key_gpu = _key(seed, positions), _key(seed, positions.cuda())
        assert torch.equal(key_cpu, key_gpu.cpu())
        for a, b in zip(_bits(key_cpu, tokens), _bits(key_gpu, tokens.cuda())):
            assert torch.equal(a, b.cpu())
        cpu, gpu = gumbel_noise(seed, positions[:8], 50_000), gumbel_noise(seed, positions[:8].cuda(), 50_000).cpu()
        ulp = torch.finfo(torch.float64).eps * cpu.abs().clamp_min(1.0)
        ratio = (cpu - gpu).abs() / ulp
        denormals = (torch.tensor([5e-324], dtype=torch.float64) * 2).item() > 0  # False where FTZ/DAZ is set
        assert (ratio <= 4).all(), (f"seed {seed}: {int((ratio > 4).sum())} of {ratio.numel()} values past 4 ulp, "
                                    f"max {ratio.max().item():.3g}; CPU {torch.backends.cpu.get_cpu_capability()}, "
                                    f"denormals kept: {denormals}")
    logits = torch.randn(6, 50_000, generator=g) * 4
    present = torch.rand(6, 50_000, generator=g) < 0.01
    pos = torch.arange(1000, 1006)
    for p in (SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.7, min_p=0.05, seed=1, penalty=1.3),
              SamplingParams(temperature=1.2, top_k=50, top_p=0.9, seed=2)):
        on_cpu = sample(process_logits(logits, present, p), p.seed, pos)
        on_gpu = sample(process_logits(logits.cuda(), present.cuda(), p), p.seed, pos.cuda())
        assert on_cpu.tolist() == on_gpu.cpu().tolist(), p


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory):
    """A tiny llama with head size 128 (flashinfer's kernels take 64, 128, 256; the check's 8B shape uses 128)."""
    from specrun.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("wide") / "m", arch="llama", hidden=256, heads=2, kv_heads=1,
                                tie_embeddings=False, seed=11))


@pytest.mark.gpu
@CUDA
def test_flashinfer_batch_engine_is_ar_up_to_near_ties(wide_heads):
    """bf16 on CUDA, n-gram drafting, three sequences in one batch: each equals its solo AR run, or parts from it first
    at a near tie (docs/design.md section 2: the row count of a forward may move the last bits)."""
    pytest.importorskip("flashinfer", reason="needs flashinfer (pip install 'specrun[cuda]')")
    from specrun.decoding.engine import BatchConfig, Engine
    from specrun.models.loader import load_model

    lm = load_model(wide_heads, dtype="bfloat16", device="cuda")
    prompts = [lm.tokenizer.encode(t) for t in ("the cat sat on the mat. the cat sat on the mat. the cat",
                                                "abc abc abc abc abc", "once upon a time")]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    # every step drafts (the recycling matrix always proposes): each verify is a masked tree per sequence
    engine = Engine(lm, EngineConfig(drafters=("ngram", "recycling"), adaptive_budget=False, trie_budget=16),
                    BatchConfig(concurrency=3, kv_tokens=3 * 256, page_size=16, backend="flashinfer"))
    got = engine.run([(i, p, params, []) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ref = Engine(lm, EngineConfig(drafters=(), step_graphs="off")).generate(p, params).token_ids
        div = check_divergence(lm, p, params, ref, got[i].token_ids)
        assert div is None or div.near_tie, (i, div)
        assert got[i].stats["mean_trie_nodes"] > 4  # trees, not single rows, went through flashinfer's masked kernel
