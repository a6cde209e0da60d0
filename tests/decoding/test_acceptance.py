"""Sampled verification is unbiased: the observed acceptance of drafted branches matches their probability mass."""

import math

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model


def test_observed_acceptance_matches_drafted_probability_mass(tmp_path):
    # a peaked random model (init std 0.3) so that drafts are accepted often enough to measure
    lm = load_model(str(build_tiny_model(tmp_path / "m", kv_heads=2, seed=3, initializer_range=0.3)), dtype="float32")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the dog")
    params = SamplingParams(max_tokens=1500, temperature=0.7, seed=3, ignore_eos=True)
    # the drafters whose children carry a drafted probability mass (the noise-coupled 4-bit chain is accepted beyond
    # its mass: it is left out of these counts)
    config = EngineConfig(drafters=("ngram", "recycling"), trie_budget=16, adaptive_budget=False)
    s = Engine(lm, config).generate(prompt, params).stats
    n, expected, observed = s["acceptance_nodes"], s["expected_acceptance"], s["observed_acceptance"]
    assert n > 1000 and 0.02 < expected < 0.98
    sigma = math.sqrt(expected * (1 - expected) / n)
    assert abs(observed - expected) < 4 * sigma, (n, expected, observed)
