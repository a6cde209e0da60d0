"""Near-tie check: AR's scores are recomputed exactly (AR's token is their argmax) and a divergence gets its true gap."""

import pytest
import torch

from specrun.bench import neartie
from specrun.bench.neartie import ar_scores, check_divergence
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams

SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, top_k=50, min_p=0.02, penalty=1.3, penalty_window=7,
                         seed=5, ignore_eos=True)


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, ignore_eos=True), SAMPLED], ids=["greedy", "sampled"])
def test_recomputed_scores_pick_every_ar_token(load_fixture, params, dtype):
    lm = load_fixture("llama_gqa", dtype=dtype)  # bf16 too: the replay is AR's own computation, bit for bit
    prompt = lm.tokenizer.encode("the cat sat on the mat")
    out = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    for i in range(0, len(out), 7):
        assert int(ar_scores(lm, prompt, out[:i], params).argmax()) == out[i]


def test_divergence_reports_the_gap_between_the_two_tokens(load_fixture, monkeypatch):
    lm = load_fixture("llama_mha")
    prompt = lm.tokenizer.encode("abc abc")
    params = SAMPLED
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    assert check_divergence(lm, prompt, params, ref, list(ref)) is None
    i = 11
    scores = ar_scores(lm, prompt, ref[:i], params)
    runner_up = int(scores.topk(2).indices[1])
    other = [*ref[:i], runner_up, *ref[i + 1 :]]
    d = check_divergence(lm, prompt, params, ref, other)
    assert (d.first_diff, d.reference_token, d.other_token) == (i, ref[i], runner_up)
    assert d.gap == pytest.approx(float(scores[ref[i]] - scores[runner_up])) and d.gap > 0
    assert d.near_tie == (d.gap <= d.tolerance)
    monkeypatch.setitem(neartie.LOGIT_TOLERANCE, torch.float64, d.gap * params.temperature * 2)
    assert check_divergence(lm, prompt, params, ref, other).near_tie  # within tolerance: reported as a near tie
    short = check_divergence(lm, prompt, params, ref, ref[:5])
    assert short.first_diff == 5 and not short.near_tie  # stopping early is never a tie


def test_a_token_cut_by_truncation_is_a_near_tie_only_within_tolerance_of_the_cut(load_fixture, monkeypatch):
    """Reduced precision can move a token across min-p's cut: its gap is the raise that keeps it plus how far it then
    is below AR's token (negated where the reference run took it); a token far below the cut stays infinitely far."""
    lm = load_fixture("llama_mha")
    prompt = lm.tokenizer.encode("abc abc")
    params = SamplingParams(max_tokens=20, temperature=1.0, min_p=0.8, seed=3, ignore_eos=True)  # flat tiny model
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    i = 6
    untruncated, noise = neartie._ar_row(lm, prompt, ref[:i], params, 256)
    cut = neartie._scores(untruncated, noise, params) == float("-inf")
    assert cut.any() and not cut.all()
    just_cut = int(torch.where(cut, untruncated.double(), float("-inf")).argmax())  # the best token min-p drops
    far = int(untruncated.argmin())
    other = [*ref[:i], just_cut, *ref[i + 1 :]]
    monkeypatch.setitem(neartie.LOGIT_TOLERANCE, torch.float64, 1e-12)
    assert check_divergence(lm, prompt, params, ref, other).gap == float("inf")  # no raise within 1e-12 keeps it
    monkeypatch.setitem(neartie.LOGIT_TOLERANCE, torch.float64, 50.0)
    d = check_divergence(lm, prompt, params, ref, other)
    raise_needed = float(untruncated.max() + torch.log(torch.tensor(params.min_p)) - untruncated[just_cut])
    assert raise_needed > 0 and raise_needed <= d.gap < float("inf") and d.near_tie
    swapped = check_divergence(lm, prompt, params, other, ref)  # the reference (not AR's run) took the cut token
    assert swapped.gap == -d.gap and swapped.near_tie
    monkeypatch.setitem(neartie.LOGIT_TOLERANCE, torch.float64, raise_needed / 2)
    assert not check_divergence(lm, prompt, params, ref, other).near_tie
    assert not check_divergence(lm, prompt, params, other, ref).near_tie
    far_d = check_divergence(lm, prompt, params, ref, [*ref[:i], far, *ref[i + 1 :]])
    assert far_d.gap == float("inf") and not far_d.near_tie
