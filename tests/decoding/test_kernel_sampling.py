"""Sampled tokens in our CPU kernel (sample_in_kernel): the tokens and processed scores of the torch path
(process_logits, then sample) bit for bit, and a speculative generation that takes it equals AR and the torch path."""

import random

import pytest
import torch

import specrun.decoding.verify.sampling as sampling
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.penalty import PenaltyWindow
from specrun.decoding.verify.sampling import SamplingParams, kernel_sampling, process_logits, sample, sample_in_kernel
from specrun.decoding.verify.sequence import Sequence, choose_together
from specrun.decoding.verify.trie import Draft, build_trie

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")
LONG_TEXT = dict(temperature=1.0, min_p=0.1, penalty=1.2, penalty_window=64)


def torch_path(logits, present, p, positions):
    processed = process_logits(logits, present, p)
    return sample(processed, p.seed, positions), processed


def assert_same(got, ref):
    """Tokens equal and processed scores equal bit for bit (-0.0 is not 0.0)"""
    assert got is not None and torch.equal(got[0], ref[0])
    assert torch.equal(got[1].view(torch.int32), ref[1].view(torch.int32))


def window_and_trie(rng, V, window, n_paths):
    """A penalty window over a random committed text and a random trie on its last token -> (window, seq, n, trie)"""
    n = rng.randrange(1, 3 * window)
    seq = torch.zeros(n + 16, dtype=torch.long)
    seq[:n] = torch.tensor([rng.randrange(V) for _ in range(n)])
    win = PenaltyWindow(V, window, torch.device("cpu"))
    win.reset(seq, n)
    root, drafts = int(seq[n - 1]), []
    for _ in range(n_paths):  # tokens of the window too, so paths re-add and push out present ones
        toks = [int(seq[rng.randrange(n)]) if rng.random() < 0.5 else rng.randrange(V)
                for _ in range(rng.randrange(1, 6))]
        drafts.append(Draft([root, *toks], list(range(-1, len(toks))), 0))
    return win, seq, n, build_trie(root, drafts, 64, torch.device("cpu"))


@needs_kernels
@pytest.mark.parametrize("V", [49152, 1001, 16, 5])
@pytest.mark.parametrize("kw", [LONG_TEXT, dict(temperature=0.7, min_p=0.05, penalty=0.8, penalty_window=9),
                                dict(temperature=1.3, min_p=0.3), dict(temperature=2.0, min_p=0.02, penalty=1.5,
                                                                       penalty_window=3)])
def test_kernel_picks_and_processes_exactly_what_the_torch_path_does(V, kw):
    rng, g = random.Random(V), torch.Generator().manual_seed(V)
    for trial in range(6):
        p = SamplingParams(seed=rng.randrange(2**63), **kw)  # seeds above 2^32 use both halves
        win, seq, n, trie = window_and_trie(rng, V, max(p.penalty_window, 1), 1 + trial)
        logits = torch.randn(trie.size, V, generator=g) * rng.choice([0.05, 1.0, 4.0])  # flat rows keep most tokens
        logits[:, ::7] = logits[:, ::7].round()  # zeros of both signs, and ties
        positions = trie.depths + n + rng.randrange(2**31 - 64)
        present = win.presence(seq, n, trie)
        ref = torch_path(logits, present if p.uses_penalty else None, p, positions)
        assert_same(sample_in_kernel(logits, win.counts, win.patches(seq, n, trie), p, positions), ref)


@needs_kernels
def test_kernel_matches_torch_on_infinite_scores_and_falls_back_on_nan():
    p = SamplingParams(seed=3, **LONG_TEXT)
    logits = torch.randn(4, 300)
    logits[0, :] = float("-inf")  # nothing kept: token 0, as the torch path gives
    logits[1, 7] = float("inf")  # only the infinite one is kept
    logits[2, ::2] = float("-inf")
    logits[3, 5] = logits[3, 9] = float("inf")  # two kept, scores + noise tied: the first
    positions = torch.tensor([4, 5, 6, 7])
    counts = (torch.rand(300) < 0.1).to(torch.int32)
    counts[[5, 7, 9]] = 0
    present = (counts > 0)[None].expand(4, -1)
    got = sample_in_kernel(logits, counts, None, p, positions)
    assert_same(got, torch_path(logits, present, p, positions))
    assert got[0].tolist()[:2] == [0, 7] and got[0][3] == 5
    logits[2, 1] = float("nan")
    assert sample_in_kernel(logits, counts, None, p, positions) is None


@needs_kernels
def test_kernel_divides_by_a_penalty_that_rounds_to_zero_as_torch_does():
    p = SamplingParams(temperature=1.0, min_p=0.1, penalty=1e-50, seed=1)  # float32(penalty) == 0
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -0.0, 1.0, 2.5]])
    counts = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0], dtype=torch.int32)
    positions = torch.tensor([9])
    assert_same(sample_in_kernel(logits, counts, None, p, positions),
                torch_path(logits, (counts > 0)[None], p, positions))


@needs_kernels
@pytest.mark.parametrize("row, col", [(0, 8), (0, -1), (1, 3)])
def test_kernel_refuses_patches_outside_the_rows(row, col):
    p = SamplingParams(seed=1, **LONG_TEXT)
    patches = (torch.tensor([row]), torch.tensor([col]), torch.tensor([True]))
    with pytest.raises(AssertionError):
        sample_in_kernel(torch.zeros(1, 8), torch.zeros(8, dtype=torch.int32), patches, p, torch.tensor([3]))


def test_kernel_takes_only_the_settings_it_computes():
    rows = torch.zeros(1, 8)
    if cpu_kernels() is not None:
        assert kernel_sampling(SamplingParams(**LONG_TEXT), rows)
    for kw in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, min_p=0.1, top_k=5),
               dict(temperature=1.0, min_p=0.1, top_p=0.9), dict(temperature=1.0, min_p=0.1, eta=0.01)):
        assert not kernel_sampling(SamplingParams(**kw), rows), kw
    assert not kernel_sampling(SamplingParams(**LONG_TEXT), rows.double())


@needs_kernels
def test_sequence_falls_back_to_torch_on_a_nan_row(monkeypatch):
    tried = []
    monkeypatch.setattr("specrun.decoding.verify.sampling.sample_in_kernel",
                        lambda *a: tried.append(1) or sample_in_kernel(*a))
    p = SamplingParams(max_tokens=8, **LONG_TEXT)
    st = Sequence([1, 2, 3], p, [], vocab_size=50, eos_ids=(), tokenizer=None, max_context=64, spare=4,
                  device=torch.device("cpu"))
    trie = build_trie(3, [], 1, torch.device("cpu"))
    logits = torch.randn(1, 50)
    logits[0, 9] = float("nan")
    choice, processed = st.choose(trie, logits)
    ref_choice, ref_processed = torch_path(logits, st.window.presence(st.seq, st.n, trie), p, trie.depths + st.n)
    assert tried and torch.equal(choice, ref_choice)
    torch.testing.assert_close(processed, ref_processed, rtol=0, atol=0, equal_nan=True)


@needs_kernels
def test_speculative_generation_through_the_kernel_equals_ar_and_the_torch_path(load_fixture, monkeypatch):
    lm = load_fixture("llama_gqa", dtype="float32")  # float32 logits: the kernel's
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    p = SamplingParams(max_tokens=120, seed=7, ignore_eos=True, **{**LONG_TEXT, "penalty_window": 16})
    calls = []
    real = sampling.sample_in_kernel

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr("specrun.decoding.verify.sampling.sample_in_kernel", counted)
    spec_config = EngineConfig(drafters=("ngram", "recycling"), trie_budget=16, adaptive_budget=False)
    spec = Engine(lm, spec_config).generate(prompt, p).token_ids
    ar = Engine(lm, EngineConfig(drafters=())).generate(prompt, p).token_ids
    assert calls and max(calls) > 1  # tries of several nodes went through the kernel, and AR's single rows
    monkeypatch.setattr("specrun.decoding.verify.sampling.kernel_sampling", lambda *a: False)
    torch_spec = Engine(lm, spec_config).generate(prompt, p).token_ids
    assert spec == ar == torch_spec and len(spec) == 120


def _sequence(rng, V, params):
    """A sequence of params over a random committed text, and a random trie on its last token"""
    n = rng.randrange(1, 40)
    st = Sequence([rng.randrange(V) for _ in range(n)], params, [], vocab_size=V, eos_ids=(), tokenizer=None,
                  max_context=4096, spare=64, device=torch.device("cpu"))
    drafts = [Draft([st.root, *toks], list(range(-1, len(toks))), 0)
              for toks in ([rng.randrange(V) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(1, 4)))]
    return st, build_trie(st.root, drafts, rng.randrange(1, 12), torch.device("cpu"))


@needs_kernels
def test_choosing_for_several_sequences_at_once_equals_each_ones_choose():
    """choose_together's one kernel call for the sequences of one kind of settings: each sequence's choose, tokens and
    processed rows bit for bit; a sequence of settings no other shares is left to its own choose (None)."""
    rng, g, V = random.Random(5), torch.Generator().manual_seed(5), 300
    kinds = [dict(LONG_TEXT, penalty_window=8), dict(LONG_TEXT, penalty_window=30), dict(temperature=1.0, min_p=0.1)]
    for trial in range(20):
        settings = [kinds[0], kinds[1], kinds[0], kinds[2], kinds[2], dict(temperature=0.7, min_p=0.2)]
        seqs, tries = zip(*[_sequence(rng, V, SamplingParams(seed=rng.randrange(2**63), **kw)) for kw in settings])
        logits = torch.randn(sum(t.size for t in tries), V, generator=g) * 3
        got, at = choose_together(list(seqs), list(tries), logits), 0
        for i, (st, trie) in enumerate(zip(seqs, tries)):
            ref = st.choose(trie, logits[at : at + trie.size])
            at += trie.size
            if i == 5:
                assert got[i] is None
            else:
                assert_same(got[i], ref)
