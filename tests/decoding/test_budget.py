"""Adaptive trie width: what each width would have accepted, the width it picks, and that output never changes."""

from specrun.decoding.budget import EXPLORE_EVERY, BudgetTuner, candidate_widths
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.sampling import SamplingParams


def test_candidate_widths():
    assert candidate_widths(64) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_widths(20) == [1, 2, 4, 8, 16, 20]
    assert candidate_widths(1) == [1]


def test_observe_credits_each_width_with_the_path_prefix_it_would_have_kept():
    t = BudgetTuner(8, forward_cost=lambda w: 1.0)
    for _ in range(200):
        t.observe(8, [1, 3, 6], 1.0)  # path nodes 1, 3, 6: width 2 keeps node 1, width 4 nodes 1 and 3, width 8 all
    assert [round(t.accepted[w], 3) for w in (1, 2, 4, 8)] == [1.0, 2.0, 3.0, 4.0]


def test_choice_trades_acceptance_against_cost_and_explores():
    cost = {1: 1.0, 2: 1.0, 4: 1.1, 8: 4.0}
    t = BudgetTuner(8, forward_cost=cost.__getitem__)
    for _ in range(200):
        t.observe(8, [1, 3, 6], cost[8])
    picks = [t.choose() for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(4) == len(picks) - 2 and picks.count(8) == 2  # 3 tokens for 1.1 beats 4 for 4.0


def test_adaptive_width_changes_nothing_in_the_output(load_fixture):
    lm = load_fixture("llama_gqa")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat")
    params = SamplingParams(max_tokens=300, temperature=0.8, min_p=0.05, seed=9, ignore_eos=True)
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    engine = Engine(lm, EngineConfig(trie_budget=32))
    assert engine.generate(prompt, params).token_ids == ref
    assert engine.tuner is not None and set(engine.tuner.cost) == {1, 2, 4, 8, 16, 32}
