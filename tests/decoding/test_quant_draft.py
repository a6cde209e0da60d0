"""The quantized self-drafter (quant.py, quant_draft.py): 4-bit products against float64, its layers against
the model's own over the same weights, AR's tokens drafted, and an output that is always AR's (I1)."""

import dataclasses

import pytest
import torch

from specrun.bench.neartie import check_divergence
from specrun.decoding.config import resolve_drafting
from specrun.decoding.drafters import quant_torch
from specrun.decoding.drafters.quant_draft import KernelForward, QuantDrafter, pick, quantized
from specrun.decoding.drafters.quant_torch import Int4Linear, Int8Linear, TorchForward, on_grid
from specrun.decoding.drafters.quant_torch import rescore as torch_rescore
from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.kv_cache import KVCache
from specrun.decoding.forward.kv_codes import KVCodes
from specrun.decoding.forward.quant import grid, quantizable, quantize
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.sampling import SamplingParams, ar_choice
from specrun.decoding.verify.trie import DraftContext
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model
from tests.decoding.test_attention import CUDA

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]
needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")
SAMPLED = SamplingParams(max_tokens=120, temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=32, seed=3,
                         ignore_eos=True)
GREEDY = SamplingParams(max_tokens=120, ignore_eos=True)
PROMPT = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 10]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head size 32 (the kernels' attention), hidden 128: every product's inputs come in groups of 32
    return build_tiny_model(tmp_path_factory.mktemp("quant") / "llama", hidden=128, heads=4, kv_heads=2, layers=3,
                            seed=5, initializer_range=0.3)


def _on_grid(lm):
    """The model's weights moved onto the drafter's 4-bit grid, as a GGUF model's are: the drafter's copy is then the
    model itself but for rounding, and drafts what AR picks."""
    for layer in lm.model.model.layers:
        for m in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(m, torch.nn.Linear):
                m.weight.data.copy_(quantize(m.weight.data)[1])
    head = lm.model.get_output_embeddings().weight
    head.data.copy_(quantize(head.data)[1])
    return lm


@pytest.mark.parametrize("n,k", [(37, 96), (160, 96), (17, 576)])
def test_quantize_and_the_product_agree_with_float64(n, k):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn((n, k), generator=gen) * 0.1
    packed, deq = quantize(w)
    groups = w.view(n, k // 32, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    # to nearest, on the float16 scale and minimum's grid (each within 2^-11 of its value: 16 steps move 2^-11 d each
    # at most)
    slack = 2 ** -11 * (groups.abs().amax(-1) + step * 16)
    assert ((deq - w).abs().view(n, k // 32, 32) <= (step / 2 + slack)[..., None] + 1e-7).all()
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no CPU kernels here")
    bias = torch.randn(n, generator=gen)
    q, d, m = (t.double() for t in grid(w))
    for rows in (1, 3, 8, 11):  # one pass, a partial pass, a full one, two passes
        x = torch.randn((rows, k), generator=gen).bfloat16()
        x[0, :32] = 0  # a group of zeros (int8 inputs: scale 0)
        for int8 in (False, True):
            ref = _on_int8_grid(x, q, d, m) if int8 else x.double() @ deq.double().T
            for b in (None, bias):
                y = kernels.gemv_q4(x, packed, n, b, int8_inputs=int8).double()
                want = ref if b is None else ref + b.double()
                assert ((y - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * want.abs().max()).all()  # bf16's rounding
            alone = torch.cat([kernels.gemv_q4(x[i : i + 1], packed, n, int8_inputs=int8) for i in range(rows)])
            assert torch.equal(alone, kernels.gemv_q4(x, packed, n, int8_inputs=int8))  # a row alone as beside others


def _on_int8_grid(x, q, d, m):
    """gemv_q4_q8's product in float64: each row's inputs coded per group of 32 (scale max |x| / 127, float32's own
    quotient, to nearest even), their codes times the weights' codes summed exactly, times both scales; the minimums
    times the coded inputs too (the weights times the inputs on their grid).

    # x: [R, K] bf16, q: [N, K], d, m: [N, K / 32] -> [R, N] float64
    """
    xg = x.float().view(x.shape[0], -1, 32)
    top = xg.abs().amax(-1, keepdim=True)
    codes = (xg * torch.where(top > 0, (127 / top.double()).float(), 0)).round()
    scale = (top / 127)[..., 0].double()
    return (torch.einsum("rgk,ngk,rg,ng->rn", codes.double(), q.view(q.shape[0], -1, 32), scale, d)
            + torch.einsum("rgk,rg,ng->rn", codes.double(), scale, m))


def test_quantize_recovers_weights_already_on_its_grid():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (20, 64), generator=gen).float()
    q[:, 0::32], q[:, 1::32] = 0, 15  # each group spans the whole grid, as a quantizer's own output does
    d = (torch.rand((20, 2, 1), generator=gen) * 0.01 + 1e-3).half().float()  # float16 scales, as GGUF's
    m = (torch.randn((20, 2, 1), generator=gen) * 0.1).half().float()
    w = (q.view(20, 2, 32) * d + m).view(20, 64)
    assert torch.allclose(quantize(w)[1], w, rtol=0, atol=1e-6)


def test_weights_beyond_float16s_scales_are_not_quantized():
    w = torch.randn(16, 64)
    assert quantizable(w) and not quantizable(w * 1e5) and not quantizable(torch.randn(16, 48))


@needs_kernels
@pytest.mark.parametrize("theta", [1.0, 1.3, 0.7])
def test_rescoring_gives_the_models_logits_for_every_token_near_the_penalised_top(theta):
    """rescore: the tokens whose penalised coarse logit is within `below` of the best one get h . W[v] rounded to bf16
    (the model's head), the rest -inf; the penalty lowers (theta > 1) or raises (theta < 1) the tokens counted."""
    gen = torch.Generator().manual_seed(int(theta * 10))
    V, H = 1000, 96
    rows, h = torch.randn((V, H), generator=gen).bfloat16(), torch.randn(H, generator=gen).bfloat16()
    exact = rows.double() @ h.double()
    coarse = (exact + torch.randn(V, generator=gen, dtype=torch.float64) * 0.5).bfloat16()
    counts = (torch.rand(V, generator=gen) < 0.3).to(torch.int32)
    counts[coarse.float().argmax()] = 2  # the coarse best is penalised
    below = 4.0 if theta >= 1 else 20.0  # a raised best (~43 against ~30) leaves the others far below
    out, (n,) = cpu_kernels().rescore(coarse[None], [counts], h[None], rows, [theta], [below])
    out, c = out[0], coarse.float()
    theta32 = torch.tensor(theta)  # float32, as the kernel computes (the sampling kernel's penalty)
    pen = torch.where(counts > 0, torch.where(c > 0, c / theta32, c * theta32), c)
    kept = pen >= pen.max() - below
    assert n == int(kept.sum()) and 1 < n < V
    assert torch.equal(out > float("-inf"), kept)
    assert ((out[kept].double() - exact[kept]).abs() <= 2 ** -8 * exact[kept].abs() + 1e-6).all()  # one rounding
    plain, _ = cpu_kernels().rescore(coarse[None], [None], h[None], rows, [1.0], [4.0])
    assert torch.equal(plain[0] > float("-inf"), c >= c.max() - 4.0)
    # rows of other counts, penalties and margins in one call: each row as it is alone
    together, ns = cpu_kernels().rescore(torch.stack([coarse, coarse]), [None, counts], torch.stack([h, h]), rows,
                                         [1.0, theta], [4.0, below])
    assert torch.equal(together, torch.cat([plain, out[None]])) and ns[1] == n


@needs_kernels
@pytest.mark.parametrize("int8_kv", [False, True], ids=["bf16-kv", "int8-kv"])
def test_the_quantized_layers_compute_what_the_model_does_on_their_weights(model_dir, int8_kv):
    """Weights on the grid: the 4-bit layers' hidden states are the bf16 layers' but for rounding (their sums run
    in another order), over the same cache, or over its int8 copy (the drafter's: codes of the new slot added)."""
    lm = _on_grid(load_model(str(model_dir), dtype="bfloat16"))
    runner = ModelRunner(lm, max_rows=16)
    runner.reset(64)
    runner.prefill(torch.tensor(PROMPT), 8)
    dec = runner.decoder
    layers = quantized(dec).layers
    cache = runner.cache
    codes = None
    if int8_kv:
        codes = KVCodes(cache.n_layers, cache.k.shape[1], cache.capacity, cache.k.shape[3])
        codes.sync(layers.kernels, cache.k, cache.v, cache.length)
    tok, pos = torch.tensor([65]), torch.tensor([len(PROMPT)])
    x = dec.embed(tok)
    cos, sin = dec.rotary(x[None], pos[None])
    ours = dec.norm(layers.rows(x, cos[0], sin[0], [cache], [cache.length], [codes])).float()
    if int8_kv:  # the new slot's codes are those of the K/V the layers wrote there
        again = KVCodes(cache.n_layers, cache.k.shape[1], cache.capacity, cache.k.shape[3])
        again.sync(layers.kernels, cache.k, cache.v, cache.length + 1)
        assert torch.equal(codes.data, again.data)
    ref = runner.forward(tok, pos, torch.ones((1, 1), dtype=torch.bool)).float()
    assert (ours - ref).abs().max() <= 0.03 * ref.abs().max()


@needs_kernels
def test_the_quantized_layers_give_each_sequence_the_rows_it_gets_alone(model_dir):
    """Several sequences in one call (their attention's items in one loop, each over its own int8 copy; one of them
    over its bf16 cache; lengths of one chunk of keys and of two): every row is the one its sequence gets alone."""
    lm = load_model(str(model_dir), dtype="bfloat16")
    gen = torch.Generator().manual_seed(1)
    caches, codes = [], []
    for n, coded in ((13, True), (300, True), (40, False), (1, True)):
        runner = ModelRunner(lm, max_rows=16)
        runner.reset(320)
        runner.prefill(torch.randint(0, 250, (n,), generator=gen), 16)
        cache = runner.cache
        c = KVCodes(cache.n_layers, cache.k.shape[1], cache.capacity, cache.k.shape[3]) if coded else None
        if c is not None:
            c.sync(quantized(runner.decoder).layers.kernels, cache.k, cache.v, cache.length)
        caches.append(cache)
        codes.append(c)
    dec = runner.decoder
    layers = quantized(dec).layers
    starts = [c.length for c in caches]
    x = dec.embed(torch.tensor([65, 66, 67, 68]))
    cos, sin = dec.rotary(x[None], torch.tensor(starts)[None])
    together = layers.rows(x, cos[0], sin[0], caches, starts, codes)
    for b in range(4):
        alone = layers.rows(x[b : b + 1], cos[0, b : b + 1], sin[0, b : b + 1], caches[b : b + 1], starts[b : b + 1],
                            codes[b : b + 1])
        assert torch.equal(alone, together[b : b + 1]), b


@needs_kernels
def test_the_drafters_copy_holds_the_codes_of_each_new_sequences_cache(model_dir):
    """A second sequence on the same engine and cache (a resume of the same prompt with another output prefix, longer
    than the first one's text): its drafter's copy is its own, slot for slot the codes of its cache's committed
    slots."""
    lm = _on_grid(load_model(str(model_dir), dtype="bfloat16"))
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False))
    # the resume leaves 11 tokens to draft for (a trie is capped at the tokens left: none are drafted for the last)
    params = SamplingParams(max_tokens=70, temperature=1.0, min_p=0.1, seed=3, ignore_eos=True)
    engine.generate(PROMPT, dataclasses.replace(params, max_tokens=30))
    first, cache = engine.quant.windows[engine.drafters[0]].codes, engine.runner.cache
    engine.generate(PROMPT, params, resume_from=[5, 6] * 29 + [5])
    codes = engine.quant.windows[engine.drafters[0]].codes  # the window holds every slot of so short a text
    n = codes.upto  # compare the synced slots only (the rest hold the last draft's rows)
    assert codes is not first and engine.runner.cache is cache and n > len(PROMPT) + 29
    fresh = KVCodes(cache.n_layers, cache.k.shape[1], codes.cap, cache.k.shape[3])
    fresh.sync(engine.quant.layers.kernels, cache.k, cache.v, n)
    assert all(torch.equal(a, b) for a, b in zip(_slots(codes, n), _slots(fresh, n)))


def _slots(codes: KVCodes, n: int) -> list[torch.Tensor]:
    """The parts of codes' bytes that hold slots [0, n) (layout of cpu_kernels.c q8_head): K tiles, V pairs, scales."""
    L, Hkv, cap, D = codes.data.shape[0], codes.Hkv, codes.cap, codes.D
    b = codes.data.view(L, -1)
    k = b[:, : Hkv * cap * D].view(L, Hkv, cap // 16, D // 4, 16, 4)
    tiles, rest = divmod(n, 16)
    v = b[:, Hkv * cap * D : 2 * Hkv * cap * D].view(L, Hkv, cap, D)
    f = b[:, 2 * Hkv * cap * D :].view(L, 3, Hkv, cap, 4)  # kscale, vscale (float32), ksum (int32) as bytes
    return [k[:, :, :tiles], k[:, :, tiles, :, :rest], v[:, :, : n - n % 2], f[:, :, :, :n]]


@needs_kernels
def test_the_int8_copy_syncs_slot_by_slot_as_at_once_and_restarts_with_a_new_sequence():
    """KVCodes.sync adds the slots committed since its last call: steps of any size give the codes of one call, and
    a shorter cache (a new sequence) is coded again from slot 0."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn((3, 2, 70, 32), generator=gen).bfloat16() for _ in range(2))
    kernels = cpu_kernels()
    once, steps = KVCodes(3, 2, 70, 32), KVCodes(3, 2, 70, 32)
    once.sync(kernels, k, v, 61)
    for n in (1, 5, 16, 17, 40, 61):
        steps.sync(kernels, k, v, n)
    assert once.cap == 80 and torch.equal(once.data, steps.data)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :9], v2[:, :, :9] = -k[:, :, :9], 2 * v[:, :, :9]
    steps.sync(kernels, k2, v2, 9)
    fresh = KVCodes(3, 2, 70, 32)
    fresh.sync(kernels, k2, v2, 9)
    steps.sync(kernels, k2, v2, 61)
    fresh.sync(kernels, k2, v2, 61)
    assert torch.equal(fresh.data, steps.data) and not torch.equal(once.data, steps.data)


# the draft forward and the model's dtype: our kernels (bf16 models on AVX-512 BF16 CPUs) or torch's int4 kernels
PATHS = [("kernels", "bfloat16"), ("torch", "float32"), ("torch", "bfloat16")]


def _model(model_dir, path: str, dtype: str, on_grid: bool = True):
    """The tiny model (on the 4-bit grid) with its draft forward chosen; skipped where our kernels cannot run."""
    if path == "kernels" and cpu_kernels() is None:
        pytest.skip("this CPU has no AVX-512 BF16 (or no C compiler)")
    lm = load_model(str(model_dir), dtype=dtype)
    if on_grid:
        _on_grid(lm)
    dec = FusedDecoder.of(lm.model)
    dec._specrun_q4 = KernelForward.of(dec) if path == "kernels" else TorchForward.of(dec)
    assert dec._specrun_q4 is not None
    return lm


def _is_ar(lm, path: str, params: SamplingParams, ar: list[int], got: list[int]) -> bool:
    """got is AR's output: token for token where the verify computes each row alone (float32, or our kernels), else
    up to a near tie (torch's bf16 products of many rows round otherwise than of one: README, Precision)."""
    if path == "kernels" or lm.dtype == torch.float32:
        return got == ar
    div = check_divergence(lm, PROMPT, params, ar, got)
    return div is None or div.near_tie


@pytest.mark.parametrize("path,dtype", PATHS)
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_drafting_with_the_4bit_copy_changes_nothing_and_is_accepted(model_dir, params, path, dtype):
    lm = _model(model_dir, path, dtype)
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False))
    result = engine.generate(PROMPT, params)
    assert isinstance(engine.drafters[0], QuantDrafter)
    assert _is_ar(lm, path, params, ar, result.token_ids)
    if path == "kernels":
        assert engine.quant.windows[engine.drafters[0]].codes.upto > 0  # it drafted over the int8 copy
    # three drafted tokens a step, most of them AR's own (a miss: a near tie that rounding or the int8 K/V codes
    # turned; this random model's logits are flat: 3.33 and 3.2 a step with int8 K/V, above 3.5 with bf16)
    assert result.stats["mean_accepted"] > 3.0, result.stats


@pytest.mark.parametrize("path,dtype", PATHS)
def test_a_penalty_below_one_drafts_and_changes_nothing(model_dir, path, dtype):
    """penalty < 1 (it raises the window's tokens; the head's candidates then come from the raised logits, see the
    rescoring test) drafts as any penalty does, and the output is AR's."""
    lm = _model(model_dir, path, dtype)
    params = SamplingParams(max_tokens=80, temperature=1.0, min_p=0.1, penalty=0.7, penalty_window=32, seed=3,
                            ignore_eos=True)
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
    result = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False)).generate(PROMPT, params)
    assert _is_ar(lm, path, params, ar, result.token_ids)
    assert result.stats["mean_accepted"] > 3.0, result.stats  # 3.2: most steps take all 4 (a miss: a near tie)


@pytest.mark.parametrize("path,dtype", PATHS)
def test_an_off_grid_model_still_gets_its_own_output(model_dir, path, dtype):
    """Random weights, far from any 4-bit grid: drafts miss more, the output is AR's all the same; the adaptive
    width and the other drafters beside it (auto) change nothing either."""
    lm = _model(model_dir, path, dtype, on_grid=False)
    for params in (GREEDY, SAMPLED):
        ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
        auto = Engine(lm, EngineConfig())
        assert "quant" in auto.names
        assert _is_ar(lm, path, params, ar, auto.generate(PROMPT, params).token_ids)


def test_where_it_cannot_run_auto_leaves_it_out_and_asking_for_it_says_why(model_dir, tmp_path):
    lm = load_model(str(model_dir), dtype="float32")
    assert quantized(FusedDecoder.of(lm.model)) is not None  # torch's kernels take float32 models too
    # an engine of several drafts with it where each sequence's K/V is one page (the CPU's layout, and the default
    # there), not over pages of 1
    assert "quant" in Engine(lm, EngineConfig(), BatchConfig(concurrency=2, page_size=256, kv_tokens=512)).names
    assert "quant" in Engine(lm, EngineConfig(), BatchConfig(concurrency=2, kv_tokens=512)).names
    assert "quant" not in Engine(lm, EngineConfig(), BatchConfig(concurrency=2, page_size=1)).names
    with pytest.raises(ValueError, match="one KV page a sequence"):
        Engine(lm, EngineConfig(drafters=("quant",)), BatchConfig(concurrency=2, page_size=1))
    odd = load_model(str(build_tiny_model(tmp_path / "odd", hidden=48, heads=2, kv_heads=1, layers=1, seed=1)))
    assert quantized(FusedDecoder.of(odd.model)) is None  # inputs of 48: not groups of 32
    assert "quant" not in Engine(odd, EngineConfig()).names
    with pytest.raises(ValueError, match="groups of 32"):
        Engine(odd, EngineConfig(drafters=("quant",)))


def test_off_the_cpu_auto_builds_no_4bit_copy_and_asking_for_it_drafts(model_dir):
    """auto drafts with the 4-bit copy on the CPU, where it is measured to pay; elsewhere (CUDA: its eager forward
    unmeasured) only when asked for. The device is the model's as resolve_drafting reads it."""
    lm = load_model(str(model_dir), dtype="float32")
    assert "quant" in resolve_drafting(EngineConfig(), lm, None)[2]
    elsewhere = dataclasses.replace(lm, device=torch.device("cuda"))
    dec = FusedDecoder.of(lm.model)
    del dec._specrun_q4  # built by the line above: the copy is built only where it is to draft
    assert "quant" not in resolve_drafting(EngineConfig(), elsewhere, None)[2]
    assert not hasattr(dec, "_specrun_q4")
    assert "quant" in resolve_drafting(EngineConfig(drafters=("quant",)), elsewhere, None)[2]
    with pytest.raises(ValueError, match="one KV page a sequence"):  # CUDA's pages of 16: a batch never drafts
        resolve_drafting(EngineConfig(drafters=("quant",)), elsewhere, None, solo=False, whole_pages=True)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_on_cuda_the_4bit_copy_drafts_through_tinygemm_and_changes_nothing(model_dir, params):
    """float32 on CUDA: the draft's products on tinygemm, its attention and picks on the GPU; the output is AR's."""
    lm = _on_grid(load_model(str(model_dir), dtype="float32", device="cuda"))
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, params).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False))
    result = engine.generate(PROMPT, params)
    assert isinstance(engine.quant, TorchForward) and engine.quant.device.type == "cuda"
    assert result.token_ids == ar
    assert result.stats["mean_accepted"] > 3.0, result.stats


@needs_kernels
@pytest.mark.parametrize("start", [0, 17, 255, 256, 700])
@pytest.mark.parametrize("T", [1, 2, 3, 17])  # 3 query heads a KV head: blocks of 3, 6, 9 and 16 + 3 rows
@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 64), (4, 4, 32), (16, 2, 128)])
def test_the_drafters_int8_attention_is_the_plain_one_up_to_its_codes(start, T, Hq, Hkv, D):
    """decode_layers_q4 attends an int8 copy of the cache (u8 queries against K codes, int16 probabilities against V
    codes) in 256-key chunks merged by log-sum-exp (the draft's values need not be AR's, only close): the rows of
    attend_bf16 to within the codes' error, masks, chunk and tile edges, odd key counts and 16-row blocks included."""
    gen = torch.Generator().manual_seed(start * 10 + T)
    cap = start + T
    k, v = (torch.randn((Hkv, cap, D), generator=gen).bfloat16() for _ in range(2))
    q = torch.randn((T, Hq, D), generator=gen).bfloat16()
    mask = None if T == 1 else (torch.rand((T, T), generator=gen) > 0.5) | torch.eye(T, dtype=torch.bool)
    kernels = cpu_kernels()
    codes = KVCodes(1, Hkv, cap, D)
    # slots past the keys hold garbage, as a drafter's copy does (its drafted rows' codes): the tails must be masked
    codes.data.copy_(torch.randint(0, 256, codes.data.shape, generator=gen, dtype=torch.uint8))
    codes.sync(kernels, k[None], v[None], cap)
    plain = kernels.attend(q, k, v, start, mask, 0.3).float()
    ours = codes.attend(kernels, q, start, mask, 0.3).float()
    # each code errs by up to 1/254 of its row's largest value (bf16: 1/512 of each value): on these Gaussian rows,
    # whose softmax at 0.3 sqrt(D) is sharp, up to 4.0% of the largest output (bf16 against float64: 0.28%)
    assert (ours - plain).abs().max() <= 0.05 * plain.abs().max()


@pytest.mark.parametrize("path,dtype", PATHS)
def test_a_repeated_passage_is_left_to_the_ngram_copy(model_dir, path, dtype):
    """Where the last 3 tokens occurred before, the n-gram copy drafts the whole width for free: no 4-bit forward."""
    lm = _model(model_dir, path, dtype, on_grid=False)
    engine = Engine(lm, EngineConfig(drafters=("quant", "ngram")))
    engine.generate(PROMPT, dataclasses.replace(GREEDY, max_tokens=1))
    quant, ngram = engine.drafters
    assert quant.copy is ngram.copy
    looped = PROMPT + PROMPT[:3]
    ngram.start(looped)
    assert not quant.wants(DraftContext(looped[-1], len(looped) - 1, budget=4, params=GREEDY))
    ngram.start(PROMPT)
    assert quant.wants(DraftContext(PROMPT[-1], len(PROMPT) - 1, budget=4, params=GREEDY))


@pytest.mark.parametrize("n,k", [(37, 96), (160, 96), (17, 576), (40, 1536)])  # rows not a multiple of 16: padded
def test_the_int4_operands_are_the_grid_as_torchs_kernels_read_it(n, k):
    """The CUDA kernel's inputs (tinygemm: element 2i of a byte pair in the high nibble, w = (q - 8) * scale + zero),
    read here by that rule and by nothing of ours, are quant.py's grid; the CPU kernel takes the same ones."""
    w = torch.randn((n, k), generator=torch.Generator().manual_seed(n)) * 0.1
    codes, scales = quant_torch.int4_operands(w)  # [N', K/2] uint8, [K/32, N', 2] bf16
    assert codes.shape == (-(-n // 16) * 16, k // 2) and scales.shape == (k // 32, codes.shape[0], 2)
    q = torch.empty((codes.shape[0], k), dtype=torch.float64)
    q[:, 0::2], q[:, 1::2] = (codes // 16).double(), (codes % 16).double()
    scale, zero = (s.double().T.repeat_interleave(32, dim=1) for s in scales.unbind(-1))  # [N', K] each
    read = (q - 8) * scale + zero
    # the scale and zero in bf16: a rounding of each, ~2^-8 of the group's size
    assert ((read[:n] - quantize(w)[1].double()).abs() <= 2 ** -7 * w.abs().amax(1, keepdim=True)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k", [(37, 96), (160, 96), (17, 576)])  # rows not a multiple of 16 are padded
def test_torchs_int4_product_is_the_float64_one_on_the_dequantized_weights(n, k, device):
    """The CPU's int4 kernel, or tinygemm on CUDA (its CPU twin: the test above)."""
    gen = torch.Generator().manual_seed(n + 1)
    w, bias = torch.randn((n, k), generator=gen) * 0.1, torch.randn(n, generator=gen)
    deq = quantize(w)[1].double()
    for b in (None, bias):
        lin = Int4Linear(w.to(device), None if b is None else b.to(device))
        for rows in (1, 5):
            x = torch.randn((rows, k), generator=gen).bfloat16()
            want = x.double() @ deq.T + (0 if b is None else b.bfloat16().double())
            y = lin(x.to(device)).double().cpu()
            assert y.shape == (rows, n)
            # bf16 output, bf16 scale and zero (a rounding of each: 2^-8 of the weights' size over the group sums)
            assert ((y - want).abs() <= 2 ** -7 * want.abs() + 0.02 * want.abs().max()).all()


@pytest.mark.parametrize("theta", [1.0, 1.3, 0.7])
def test_torch_rescoring_gives_the_models_logits_for_every_token_near_the_penalised_top(theta):
    """The rule of the C kernel's rescore_bf16 in torch, for several rows at once: each row's tokens within its `below`
    of its own penalised coarse best get h . W[v], the rest -inf (a row without counts unpenalised, whatever the others
    keep); the same kept set as the kernel where it runs."""
    gen = torch.Generator().manual_seed(int(theta * 10) + 1)
    V, H, B = 1000, 96, 3
    rows, h = torch.randn((V, H), generator=gen).bfloat16(), torch.randn((B, H), generator=gen).bfloat16()
    exact = h.double() @ rows.double().T  # [B, V]
    coarse = (exact + torch.randn((B, V), generator=gen, dtype=torch.float64) * 0.5).bfloat16()
    counts = [(torch.rand(V, generator=gen) < 0.3).to(torch.int32) for _ in range(B)]
    counts[1] = None
    for b in (0, 2):
        counts[b][coarse[b].float().argmax()] = 2
    thetas, belows = [theta, theta, 1.1], [4.0 if theta >= 1 else 20.0, 3.0, 6.0]
    out = torch_rescore(coarse.float(), counts, h, rows, thetas, belows)
    theirs = None if cpu_kernels() is None else cpu_kernels().rescore(coarse, counts, h, rows, thetas, belows)[0]
    for b in range(B):
        c = coarse[b].float()
        pen = c if counts[b] is None else torch.where(counts[b] > 0, torch.where(c > 0, c / thetas[b], c * thetas[b]), c)
        kept = pen >= pen.max() - belows[b]
        assert 1 < int(kept.sum()) < V and torch.equal(out[b] > float("-inf"), kept), b
        assert ((out[b, kept].double() - exact[b, kept]).abs() <= 2 ** -8 * exact[b, kept].abs() + 1e-6).all(), b
        if theirs is not None:
            assert torch.equal(theirs[b] > float("-inf"), kept)


def test_a_depths_rows_are_each_picked_as_alone():
    """pick over several rows (sampled and greedy settings, seeds of their own, a row without counts) gives each row the
    token ar_choice gives it alone at its position, its own counts penalised: grouping rows changes no pick."""
    gen = torch.Generator().manual_seed(3)
    V, B = 500, 6
    logits = torch.randn((B, V), generator=gen) * 3
    sampled = SamplingParams(max_tokens=8, temperature=1.0, min_p=0.05, penalty=3.0, seed=7)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, penalty=3.0)
    other, third = dataclasses.replace(sampled, seed=8), dataclasses.replace(sampled, seed=9)
    params = [sampled, greedy, sampled, other, greedy, third]
    counts = [(torch.rand(V, generator=gen) < 0.2).to(torch.int32) for _ in range(B)]
    for b in range(B):  # each row's best tokens counted: its penalty moves its pick
        counts[b][logits[b].topk(3).indices] = b % 2
    counts[3] = None
    positions = [10, 11, 12, 40, 41, 10]
    got = pick(logits, counts, params, positions)
    want = [int(ar_choice(logits[b : b + 1], params[b], torch.tensor([positions[b]]), lambda n=n: (n, None),
                          lambda n=n: None if n is None else (n > 0)[None])[0][0]) for b, n in enumerate(counts)]
    assert got == want
    assert got != pick(logits, [None] * B, params, positions)  # the counts do move picks
    # the same rows as a compiled draft's candidates: 40 columns a row standing for token ids, its best among them
    tops = [logits[b].topk(20).indices for b in range(B)]
    others = [torch.randperm(V, generator=gen) for _ in range(B)]
    ids = torch.stack([torch.cat([t, o[~torch.isin(o, t)][:20]]).sort().values for t, o in zip(tops, others)])
    sparse = torch.full_like(logits, float("-inf")).scatter_(1, ids, logits.gather(1, ids))
    assert pick(logits.gather(1, ids), counts, params, positions, ids) == pick(sparse, counts, params, positions)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torchs_int4_forward_computes_what_the_model_does_on_its_weights(model_dir, dtype, device):
    """Weights on the grid: the int4 forward's logits (rescored candidates) are the model's own for the root and for a
    drafted token after it, but for bf16 rounding; its K/V land in the slots after the committed ones."""
    lm = _on_grid(load_model(str(model_dir), dtype=dtype, device=device))
    runner = ModelRunner(lm, max_rows=16)
    runner.reset(64)
    runner.prefill(torch.tensor(PROMPT, device=device), 8)
    fwd = TorchForward.of(runner.decoder)
    assert fwd.bits == 4 and fwd.device.type == device
    n = runner.cache.length
    fwd.begin([runner.cache], [n], 2)
    every = ([None], [1.0], [1e9])  # every token a candidate
    draft = [fwd.logits(0, [65], *every)[0], fwd.logits(1, [66], *every)[0]]
    drafted_k = runner.cache.k[:, :, n : n + 2].float().clone()
    hidden = runner.forward(torch.tensor([65, 66], device=device), torch.tensor([n, n + 1], device=device),
                            torch.ones((2, 2), dtype=torch.bool, device=device).tril_())
    ref = runner.logits(hidden)
    for got, want in zip(draft, ref):
        assert (got - want).abs().max() <= 0.05 * want.abs().max()
    k = runner.cache.k[:, :, n : n + 2].float()
    assert (drafted_k - k).abs().max() <= 0.05 * k.abs().max()


def test_the_int4_draft_attends_the_sinks_and_the_recent_window(monkeypatch):
    """Past SINKS + WINDOW slots the draft attends the first SINKS and the last WINDOW, as attention over exactly
    those slots computes it (the slots between are not read); shorter caches are attended whole."""
    monkeypatch.setattr(quant_torch, "SINKS", 2)
    monkeypatch.setattr(quant_torch, "WINDOW", 5)
    gen = torch.Generator().manual_seed(2)
    Hq, Hkv, D, S = 4, 2, 32, 40
    cache = KVCache(1, S, Hkv, D, torch.float32, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn((Hq, D), generator=gen).bfloat16()

    def over(slots):
        k, v = cache.k[0][:, slots], cache.v[0][:, slots]  # [Hkv, n, D]
        qg = q.float().view(Hkv, Hq // Hkv, D)
        p = torch.softmax(qg @ k.transpose(1, 2) * 0.2, dim=-1)
        return (p @ v).reshape(Hq, D)

    for n in (3, 7, 8, 30):
        got = TorchForward._attend(cache, 0, q, n, 0.2).float()
        slots = list(range(n)) if n <= 7 else [0, 1, *range(n - 5, n)]
        assert (got - over(slots)).abs().max() <= 0.02, n
        if n > 7:
            assert (got - over(list(range(n)))).abs().max() > 0.05  # the whole cache would give other values


@pytest.mark.parametrize("path,dtype", [("torch", "float32"), ("kernels", "bfloat16")])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_batched_worker_drafts_every_sequence_with_the_4bit_copy_and_each_gets_its_own_output(model_dir, params,
                                                                                                 path, dtype):
    """Three prompts at once (one KV page each, as a CPU worker holds them): every chain through one 4-bit forward a
    depth, each over its own page (on our kernels: its own window); each output is its solo AR run's, and the chains
    are accepted. (Torch's eager draft drafts several sequences under compile_draft off only.)"""
    lm = _model(model_dir, path, dtype)
    prompts = [PROMPT, PROMPT[:5] + [50, 60, 70], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    ar = [Engine(lm, EngineConfig(drafters=())).generate(p, params).token_ids for p in prompts]
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_draft="off"),
                    BatchConfig(concurrency=3, kv_tokens=3 * 256, page_size=256))
    got = engine.run([(i, p, params, []) for i, p in enumerate(prompts)])
    for i in range(3):
        assert got[i].token_ids == ar[i], i
        assert got[i].stats["mean_accepted"] > 3.0, got[i].stats
    if path == "kernels":  # each sequence drafted in a window of its own, freed with its drafter
        assert isinstance(engine.quant, KernelForward) and not engine.quant.windows
        assert len(engine.quant.active) >= 1 and all(w.upto > len(PROMPT) for w in engine.quant.active)


def test_the_torch_draft_takes_4_bits_where_the_weights_sit_on_a_4bit_grid_else_8(model_dir):
    """A GGUF Q4 model's weights sit on the grid: 4 bits keep them whole. A model trained in bf16 loses too much to
    4 bits (smollm2 off its grid: ~48% of drafted tokens accepted): its layers go in 8 bits."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn((64, 96), generator=gen) * 0.05
    assert not on_grid([w]) and on_grid([quantize(w)[1]])
    assert TorchForward.of(FusedDecoder.of(_on_grid(load_model(str(model_dir))).model)).bits == 4
    off = TorchForward.of(FusedDecoder.of(load_model(str(model_dir)).model))
    assert off.bits == 8 and isinstance(off.layers[0].qkv, Int8Linear)


@pytest.mark.parametrize("n,k", [(37, 96), (17, 576)])
def test_torchs_int8_product_is_the_float64_one_within_its_rounding(n, k):
    gen = torch.Generator().manual_seed(n + 2)
    w, bias = torch.randn((n, k), generator=gen) * 0.1, torch.randn(n, generator=gen)
    x = torch.randn((3, k), generator=gen).bfloat16()
    for b in (None, bias):
        want = x.double() @ w.double().T + (0 if b is None else b.bfloat16().double())
        y = Int8Linear(w, b)(x).double()
        # a code errs by half of its row's step (max |w| / 127), summed over k inputs; bf16 output
        assert ((y - want).abs() <= 2 ** -7 * want.abs() + 0.02 * want.abs().max()).all()


def test_a_draft_whose_compile_fails_drafts_eagerly_after_one_warning(model_dir, monkeypatch, capsys):
    """compile_draft on a host where torch.compile fails (no C++ compiler, an inductor error): a warning naming the
    error, then torch's eager draft for this and every later generation (no second try); the output is AR's."""
    from specrun.decoding.drafters.quant_ring import RingForward

    tries = []

    def fails(ring, batched=False):
        tries.append(batched)
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(RingForward, "warm", fails)
    lm = _model(model_dir, "torch", "float32")
    ar = Engine(lm, EngineConfig(drafters=())).generate(PROMPT, SAMPLED).token_ids
    engine = Engine(lm, EngineConfig(drafters=("quant",), trie_budget=4, adaptive_budget=False, compile_draft="on"))
    eager = engine.quant
    for _ in range(2):
        result = engine.generate(PROMPT, SAMPLED)
        assert result.token_ids == ar and result.stats["mean_accepted"] > 3.0, result.stats
    assert engine.quant is eager and isinstance(eager, TorchForward) and tries == [False]
    assert "compiling the quantized self-draft failed (RuntimeError: no C++ compiler found)" in capsys.readouterr().err
    batched = Engine(lm, EngineConfig(drafters=("quant",), compile_draft="on"),
                     BatchConfig(concurrency=2, kv_tokens=512, page_size=256))
    assert batched.admit(0, PROMPT, SAMPLED) and batched.quant is eager and tries == [False]


def test_a_batched_engine_tunes_greedy_steps_apart_from_sampled_ones(model_dir):
    """Steps whose sequences are all greedy have a tuner of their own, without the 4-bit chain's
    rules (the n-gram copy drafts greedy loops); a step with any sampled sequence drafts as sampled text."""
    lm = _model(model_dir, "torch", "float32")
    engine = Engine(lm, EngineConfig(drafters=("quant", "ngram"), compile_draft="off"),
                    BatchConfig(concurrency=2, kv_tokens=512, page_size=256))
    greedy, sampled = dataclasses.replace(GREEDY, max_tokens=8), dataclasses.replace(SAMPLED, max_tokens=24)
    assert engine.admit(0, PROMPT, greedy) and engine.admit(1, PROMPT[:5], sampled)
    engine.run([])
    assert set(engine._tuners) == {(2, False, True), (1, False, True)}  # both, then the sampled one alone
    engine.run([(2, PROMPT, greedy, [])])
    assert set(engine._tuners) == {(2, False, True), (1, False, True), (1, True, True)}
    assert engine._tuners[1, True, True].chain == 0 and engine._tuners[1, False, True].chain > 0
    auto = Engine(lm, EngineConfig(drafters=("quant", "ngram")), BatchConfig(concurrency=2, kv_tokens=512, page_size=256))
    auto.run([(0, PROMPT, sampled, []), (1, PROMPT[:5], sampled, [])])  # the eager chain waits for its compile:
    assert (2, False, False) in auto._tuners and all(not key[2] and t.chain == 0 for key, t in auto._tuners.items())
