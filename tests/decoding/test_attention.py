"""Attention backends: log-sum-exp merge, split (prefix + trie) against masked SDPA, and whole generations per backend."""

import pytest
import torch
import torch.nn.functional as F

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.forward.attention import attend_lse, merge_states
from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.trie import Draft, build_trie

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_merged_halves_equal_attention_over_all_keys(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 16, generator=g, dtype=torch.float64) for n in (5, 40, 40))
    ref = F.scaled_dot_product_attention(q, k, v)
    ref_lse = torch.logsumexp(q @ k.transpose(-1, -2) / 4.0, dim=-1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    o1, l1 = attend_lse(q, k[:, :29], v[:, :29], None)  # unmasked: the CPU flash kernel
    o2, l2 = attend_lse(q, k[:, 29:], v[:, 29:], None, torch.ones(5, 11, dtype=torch.bool))  # masked: explicit
    o, lse = merge_states(o1, l1, o2, l2)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(o.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


def test_masked_keys_get_no_weight():
    q, k, v = torch.randn(1, 3, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    o, _ = attend_lse(q, k, v, None, mask)
    v2 = v.clone()
    v2[0, 3] = 1e3  # only row 2 sees key 3
    o2, _ = attend_lse(q, k, v2, None, mask)
    assert torch.equal(o[0, :2], o2[0, :2]) and not torch.allclose(o[0, 2], o2[0, 2])


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2"])
def test_split_verify_forward_equals_sdpa_on_a_random_trie(load_fixture, name):
    """Same cache, same trie: the split backend's hidden states match the masked-SDPA reference."""
    lm = load_fixture(name)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 200, (37,), generator=g)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 4]
    trie = build_trie(5, [Draft([5, *torch.randint(0, 200, (9,), generator=g).tolist()], parents, 0)], 16, "cpu")
    hidden = {}
    for backend in ("sdpa", "split"):
        runner = ModelRunner(lm, max_rows=64, backend=backend)
        runner.reset(128)
        runner.prefill(prefix, chunk=16)  # chunks after the first run the split path too
        hidden[backend] = runner.forward(trie.tokens, trie.depths + 37, trie.ancestors)
    torch.testing.assert_close(hidden["split"], hidden["sdpa"], atol=1e-10, rtol=1e-10)


def test_split_backend_generations_equal_the_reference(load_fixture):
    lm = load_fixture("llama_gqa")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    greedy = SamplingParams(max_tokens=200, ignore_eos=True)
    sampled = SamplingParams(max_tokens=150, temperature=0.9, min_p=0.05, seed=4, ignore_eos=True)
    for params in (greedy, sampled):
        ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
        for drafters in ((), None):
            out = Engine(lm, EngineConfig(drafters=drafters, attention="split")).generate(prompt, params).token_ids
            assert out == ref, (params.temperature, drafters)


def test_unknown_backend_is_refused(load_fixture):
    with pytest.raises(ValueError, match="attention backend 'flash'"):
        EngineConfig(attention="flash")


@pytest.mark.gpu
@CUDA
def test_backends_agree_on_cuda(load_fixture):
    lm = load_fixture("llama_gqa", device="cuda")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    for backend in ("sdpa", "split"):
        assert Engine(lm, EngineConfig(attention=backend)).generate(prompt, params).token_ids == ref, backend
