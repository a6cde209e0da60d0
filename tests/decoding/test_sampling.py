"""Noise function, logit processing against transformers' warpers, and the sampler's distribution."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers.generation.logits_process import (
    EtaLogitsWarper,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specrun.decoding.verify.sampling import FEW_PAIRS, SamplingParams, choose, gumbel_at, gumbel_noise, process_logits
from specrun.errors import ConfigError


def test_noise_is_a_pure_function_of_seed_position_token():
    a = gumbel_noise(7, torch.tensor([0, 5, 100_000]), 1000)
    b = gumbel_noise(7, torch.tensor([100_000, 5]), 1000)
    assert torch.equal(a[2], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a, gumbel_noise(8, torch.tensor([0, 5, 100_000]), 1000))
    assert torch.equal(gumbel_noise(7, torch.tensor([5]), 50)[0], a[1, :50])  # vocab size does not shift the stream
    assert torch.equal(gumbel_noise(2**62 + 3, torch.tensor([1]), 10), gumbel_noise(2**62 + 3, torch.tensor([1]), 10))


@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5, 2**63 - 1])
def test_noise_at_few_pairs_is_the_full_rows_noise_bit_for_bit(seed):
    """gumbel_at hashes up to FEW_PAIRS pairs in Python integers, more in tensors: the bits of gumbel_noise's rows, for
    positions and token ids up to 2**31 - 1 (token + 0x9E3779B9 passes 2**32 there)."""
    g = torch.Generator().manual_seed(seed % 1000)
    positions = torch.randint(0, 2**31 - 1, (40,), generator=g)
    tokens = torch.randint(0, 1000, (40,), generator=g)
    assert torch.equal(gumbel_at(seed, positions, tokens), gumbel_noise(seed, positions, 1000)[torch.arange(40), tokens])
    big = torch.randint(0, 2**31 - 1, (FEW_PAIRS + 1,), generator=g)
    few, many = gumbel_at(seed, big[:FEW_PAIRS], big[:FEW_PAIRS]), gumbel_at(seed, big, big)  # integers / tensors
    assert few.dtype == many.dtype == torch.float64 and torch.equal(few, many[:FEW_PAIRS])


def test_noise_is_standard_gumbel():
    g = gumbel_noise(1, torch.arange(200), 5000).flatten().numpy()
    assert stats.kstest(g, "gumbel_r").pvalue > 1e-3
    assert abs(g.mean() - 0.5772156649) < 0.01
    assert abs(g.var() - math.pi**2 / 6) < 0.03


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_noise_identical_on_cuda():
    pos = torch.arange(64)
    assert torch.allclose(gumbel_noise(3, pos, 4096), gumbel_noise(3, pos.cuda(), 4096).cpu(), rtol=0, atol=1e-12)


def hf_reference(logits, present_ids, p: SamplingParams):
    x = logits.clone()
    if p.penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.penalty)(present_ids[None], x[None])[0]
    x = TemperatureLogitsWarper(p.temperature)(None, x[None])[0]
    for w in (
        TopKLogitsWarper(p.top_k) if p.top_k else None,
        TopPLogitsWarper(p.top_p) if p.top_p < 1 else None,
        MinPLogitsWarper(p.min_p) if p.min_p else None,
        EtaLogitsWarper(p.eta, device="cpu") if p.eta else None,
    ):
        if w is not None:
            x = w(None, x[None])[0]
    return x


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.3, min_p=0.05, penalty=1.4),
        dict(temperature=0.9, eta=0.002),
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, eta=0.001, penalty=1.2),
    ],
)
def test_processing_matches_transformers_warpers(kw):
    torch.manual_seed(0)
    p = SamplingParams(**kw)
    logits = torch.randn(500, dtype=torch.float64) * 3
    present_ids = torch.randint(0, 500, (40,))
    present = torch.zeros(1, 500, dtype=torch.bool)
    present[0, present_ids] = True
    ours = process_logits(logits[None], present, p)[0]
    ref = hf_reference(logits, present_ids, p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    keep = ~torch.isinf(ref)
    assert torch.allclose(ours[keep], ref[keep], atol=1e-12)


def test_greedy_is_argmax_after_penalty():
    logits = torch.tensor([[1.0, 3.0, 2.9, -1.0]])
    present = torch.tensor([[False, True, False, False]])
    p = SamplingParams(penalty=1.5)
    assert choose(process_logits(logits, present, p), None).item() == 2
    assert choose(process_logits(logits, None, SamplingParams()), None).item() == 1


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_sampler_matches_processed_distribution(penalty):
    torch.manual_seed(1)
    V, N = 40, 6000
    logits = torch.randn(1, V, dtype=torch.float64) * 1.5
    present = torch.zeros(1, V, dtype=torch.bool)
    present[0, :10] = True
    p = SamplingParams(temperature=0.9, top_k=15, penalty=penalty)
    processed = process_logits(logits, present, p)
    probs = processed.softmax(-1)[0]
    counts = torch.zeros(V)
    for seed in range(N):
        counts[choose(processed, gumbel_noise(seed, torch.tensor([17]), V)).item()] += 1
    kept = probs > 0
    assert counts[~kept].sum() == 0
    res = stats.chisquare(counts[kept].numpy(), (probs[kept] * N).numpy())
    assert res.pvalue > 1e-3


@pytest.mark.parametrize("kw, fault", [
    ({"temperature": float("inf")}, "finite"), ({"penalty": float("nan")}, "finite"),
    ({"temperature": 1e-320}, "greedy"), ({"top_k": 2**63}, "top_k"), ({"penalty_window": 10**23}, "penalty_window"),
    ({"max_tokens": 2**40}, "max_tokens"), ({"seed": -1}, "seed"),
])
def test_params_refuse_values_that_would_break_sampling(kw, fault):
    with pytest.raises(ConfigError, match=fault):  # a SpecrunError (the API's family), and a ValueError
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, fault", [
    ({"max_tokens": 2.5}, "max_tokens=2.5 must be an integer"), ({"max_tokens": True}, "max_tokens=True must be an"),
    ({"penalty_window": 1.5}, "penalty_window=1.5 must be"), ({"seed": "1"}, "seed='1' must be an integer"),
    ({"temperature": "hot"}, "temperature='hot' must be a finite number"), ({"top_p": None}, "top_p=None"),
    ({"ignore_eos": "no"}, "ignore_eos='no' must be True or False"), ({"stop": None}, "stop must be a string"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"), ({"stop": ["ok", "\udcff"]}, "lone surrogate .* stop.1"),
])
def test_params_refuse_a_value_of_the_wrong_type_naming_it(kw, fault):
    """Caught where the value is given, not deep in a generation (a float max_tokens failed in torch.zeros, a string
    ignore_eos counted as True); a command line's undecodable bytes in a stop string, before any job is written."""
    with pytest.raises(ConfigError, match=fault):
        SamplingParams(**kw)


def test_params_take_numpys_numbers_as_pythons():
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5))
    assert type(p.max_tokens) is int and type(p.temperature) is float and p.max_tokens == 5


@pytest.mark.parametrize("kw", [{"min_p": 0.2}, {"top_k": 3}, {}, {"top_p": 0.5}])
def test_sparse_noise_picks_exactly_what_full_noise_rows_pick(kw):
    from specrun.decoding.verify.sampling import sample

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 300, generator=g, dtype=torch.float64) * 3
    p = SamplingParams(temperature=0.9, **kw)
    processed = process_logits(logits, None, p)
    positions = torch.randint(0, 50, (40,), generator=g)
    dense = choose(processed, gumbel_noise(11, positions, 300))
    assert torch.equal(sample(processed, 11, positions), dense)


@pytest.mark.parametrize("kw", [{"min_p": 0.2}, {"top_k": 3}, {}])
def test_a_rows_candidates_pick_what_its_whole_row_picks(kw):
    """sample over a few columns standing for token ids (a draft's candidates, ascending; the rest -inf): the token
    the whole row gives at the same position, noise drawn at the ids, not the columns."""
    from specrun.decoding.verify.sampling import sample

    g = torch.Generator().manual_seed(2)
    T, V, C = 30, 300, 24
    ids = torch.stack([torch.randperm(V, generator=g)[:C].sort().values for _ in range(T)])  # [T, C]
    logits = torch.full((T, V), float("-inf"), dtype=torch.float64)
    logits.scatter_(1, ids, torch.randn(T, C, generator=g, dtype=torch.float64) * 3)
    p = SamplingParams(temperature=0.9, **kw)
    processed = process_logits(logits, None, p)
    positions = torch.randint(0, 50, (T,), generator=g)
    whole = sample(processed, 11, positions)
    assert torch.equal(sample(processed.gather(1, ids), 11, positions, ids), whole)
    at_columns = ids.gather(1, sample(processed.gather(1, ids), 11, positions)[:, None])[:, 0]
    assert not torch.equal(at_columns, whole)  # the noise drawn at the columns instead: other picks


def test_sparse_noise_breaks_ties_at_the_first_column_as_argmax_does(monkeypatch):
    from specrun.decoding.verify import sampling

    # zero noise makes equal processed scores tie exactly: the sparse pick must be dense argmax's (first column)
    monkeypatch.setattr(sampling, "gumbel_at", lambda seed, pos, tok: torch.zeros(tok.shape, dtype=torch.float64))
    ninf = float("-inf")
    processed = torch.tensor([[ninf, 2.0, 2.0, ninf, 1.0, ninf, ninf, ninf],
                              [0.5, ninf, ninf, ninf, ninf, ninf, ninf, 0.5],
                              [ninf, ninf, ninf, ninf, ninf, ninf, -3.0, ninf]])
    assert sampling.sample(processed, 0, torch.tensor([4, 5, 6])).tolist() == processed.argmax(-1).tolist() == [1, 0, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalty_touches_only_window_tokens_with_the_whole_row_formula(dtype):
    from specrun.decoding.verify.sampling import apply_penalty

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 1000, generator=g) * 4).to(dtype)
    present = torch.rand(5, 1000, generator=g) < 0.05
    before = logits.clone()
    dense = torch.where(present, torch.where(logits > 0, logits / 1.3, logits * 1.3), logits)
    assert torch.equal(apply_penalty(logits, present, 1.3), dense)
    assert torch.equal(logits, before)  # the caller's logits are left as they were


def test_a_row_with_nothing_kept_samples_token_0_as_argmax_does():
    from specrun.decoding.verify.sampling import sample

    nan, ninf = float("nan"), float("-inf")
    processed = torch.full((3, 50), ninf)
    processed[0, 7] = 1.0
    processed[1] = nan  # e.g. logits that overflowed: nothing is > -inf, nothing is kept
    assert sample(processed, 0, torch.tensor([3, 4, 5])).tolist() == [7, 0, 0]
