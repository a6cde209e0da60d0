"""Adaptive trie width: what each width would have accepted, the width it picks, and that output never changes."""

import pytest

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.kernels.cpu_kernels import cpu_kernels
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.width.acceptance import EMA
from specrun.decoding.width.costs import COST_WINDOW
from specrun.decoding.width.explore import EXPLORE_EVERY, EXPLORE_EVERY_AR, EXPLORE_MAX_AR
from specrun.decoding.width.tuner import STAY_MARGIN, WIDER_MARGIN, WidthTuner, candidate_widths
from specrun.models.loader import load_model
from specrun.models.tiny import build_tiny_model


def test_candidate_widths():
    assert candidate_widths(64) == [1, 2, 4, 8, 16, 32, 64]
    assert candidate_widths(20) == [1, 2, 4, 8, 16, 20]
    assert candidate_widths(1) == [1]
    assert candidate_widths(64, fine=True) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert candidate_widths(20, fine=True) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    assert WidthTuner(16, narrow_bounds=False).widths == [1, 2, 3, 4, 6, 8, 12, 16]


def _timed(t: WidthTuner, cost: dict, path=(1, 3, 6), steps=200) -> None:
    for w in cost:  # timed steps make a width's cost known (a width timed once is timed again first)
        t.observe(w, [], cost[w])
        t.observe(w, [], cost[w])
    for _ in range(steps):
        t.observe(max(cost), list(path), cost[max(cost)])


def test_observe_credits_each_width_with_the_path_prefix_it_would_have_kept():
    t = WidthTuner(8)
    _timed(t, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0})
    assert [round(t.accepted[w], 3) for w in (1, 2, 4, 8)] == [1.0, 2.0, 3.0, 4.0]


def test_choice_trades_acceptance_against_cost_and_explores():
    cost = {1: 1.0, 2: 1.0, 4: 1.1, 8: 4.0}
    t = WidthTuner(8)
    _timed(t, cost)
    picks = [t.choose() for _ in range(2 * EXPLORE_EVERY)]
    assert picks.count(4) == len(picks) - 2  # 3 tokens for 1.1 beats 4 for 4.0
    assert picks[EXPLORE_EVERY - 1] == 8 and picks[2 * EXPLORE_EVERY - 1] == 8  # one wider now and then


def test_a_wider_width_must_beat_the_narrower_by_the_margin():
    """Sampled text: width 2's drafts are accepted now and then; a gain below the margin keeps plain AR steps."""
    for every, wanted in ((50, 1), (5, 2)):
        t = WidthTuner(2)
        t.observe(1, [], 1.0)
        t.observe(1, [], 1.0)
        t.observe(2, [], 1.0)
        for k in range(1000):  # width 2's second node accepted every `every`-th step
            t.observe(2, [1] if k % every == 0 else [], 1.0)
        gain = (t.accepted[2] / t.cost[2]) / (t.accepted[1] / t.cost[1])
        assert (1.0 < gain < 1 + WIDER_MARGIN) if wanted == 1 else gain > 1 + WIDER_MARGIN  # what the case is about
        picks = [t.choose() for _ in range(EXPLORE_EVERY_AR - 1)]
        off_best = len(picks) // EXPLORE_EVERY if wanted > 1 else 0  # exploring steps (AR explores less often)
        assert picks.count(wanted) >= len(picks) - off_best, (every, t.accepted, t.cost, picks)


def test_no_width_is_costed_below_plain_ar():
    """Costs are minima over windows of different ages: width 2's fast minimum from a quiet spell against plain AR's
    fresh one from a slow spell must not make drafts that miss look cheaper than plain steps."""
    t = WidthTuner(4)
    for w, seconds in ((1, 1.0), (1, 1.0), (2, 0.9), (2, 0.9), (4, 0.95), (4, 0.95)):
        t.observe(w, [], seconds)  # no draft accepted: every width is worth one token a step
    for _ in range(COST_WINDOW):
        t.observe(1, [], 1.2)  # a slow spell: plain AR's window now holds only slow steps
    assert t.cost == {1: 1.2, 2: 0.9, 4: 0.95}
    assert t.estimated_cost(2) == t.estimated_cost(4) == 1.2
    assert [t.choose() for _ in range(EXPLORE_EVERY_AR - 2)] == [1] * (EXPLORE_EVERY_AR - 2)


def lead(t: WidthTuner, rival: int, held: int) -> float:
    """How far the rival width's estimated tokens per second lead the held width's (0.03 = 3%)."""
    return (t.accepted[rival] / t.estimated_cost(rival)) / (t.accepted[held] / t.estimated_cost(held)) - 1


def test_the_width_in_use_keeps_its_place_unless_another_beats_it_by_the_stay_margin():
    """A slow spell lifts the cost of the width in use while a rival keeps the minimum of a quieter spell: a rival
    ahead by less than the margin does not take over; one ahead by more does."""
    t = WidthTuner(8, narrow_bounds=False)
    for w, seconds in ((1, 1.0), (1, 1.0), (2, 1.6), (2, 1.6), (3, 2.2), (3, 2.2), (4, 2.8), (4, 2.8), (6, 3.6),
                       (6, 3.6), (8, 6.0), (8, 6.0)):
        t.observe(w, [1, 2, 3, 4, 5] if w == 8 else list(range(1, w)), seconds)  # every drafted node accepted
    for _ in range(50):
        t.observe(6, [1, 2, 3, 4, 5], 3.6)  # width 6: 6 tokens for 3.6 s; width 4: 4 for 2.8
    assert t.choose() == 6
    for _ in range(COST_WINDOW):
        t.observe(6, [1, 2, 3, 4, 5], 4.33)  # a slow spell: width 4's minimum (a quieter spell's) now leads by 3%
    assert 0 < lead(t, 4, 6) < STAY_MARGIN  # the tuner's own estimates put width 4 ahead, by less than the margin
    assert [t.choose() for _ in range(EXPLORE_EVERY - 2)].count(6) >= EXPLORE_EVERY - 3  # (one step explores width 8)
    for _ in range(COST_WINDOW):
        t.observe(6, [1, 2, 3, 4, 5], 4.7)  # slower still: width 4 leads by 12%
    assert lead(t, 4, 6) > STAY_MARGIN
    assert [t.choose() for _ in range(3)] == [6, 4, 4]  # (the first explores the next wider: 6)


def test_a_stale_slow_width_does_not_hold_back_the_wider_ones():
    t = WidthTuner(8)
    for w, seconds in ((1, 1.0), (1, 1.0), (2, 1.0), (2, 1.0), (4, 5.0), (4, 5.0), (8, 1.1), (8, 1.1)):
        t.observe(w, [], seconds)  # width 4 was only ever timed in a slow spell
    for _ in range(20):
        t.observe_shadow([[1, 3, 5]])  # the full trie keeps 3 nodes a step: width 8 is worth 4 tokens, width 4 three
    assert t.estimated_cost(8) == 1.1
    assert t.choose() == 8


def test_unmeasured_widths_cost_double_for_each_width_skipped():
    """Shadow tries can credit a 64-node trie with more tokens than narrower ones before it was ever timed: its cost is
    not the 2-node step's (a jump from width 2 to 64 once cost 8 plain steps a step); the next width up is explored at
    the measured cost, each one past it at twice the one before."""
    t = WidthTuner(64)
    for w in (1, 1, 2, 2):
        t.observe(w, [], 1.0)
    assert [t.estimated_cost(w) for w in t.widths] == [1.0, 1.0, 1.0, 2.0, 4.0, 8.0, 16.0]
    t.observe_shadow([[1, 2, 3, 40]])  # the full trie would have kept 4 nodes, the 4-node one 3, the 2-node one 1
    assert t.choose() == 4


def test_shadows_can_lead_past_a_width_whose_nodes_miss():
    """Drafts whose first nodes miss and later ones hit: width 4 gains nothing, width 8 much; skipping one width is
    worth it when the shadows say so (it is then timed and costed as measured)."""
    t = WidthTuner(8)
    for w in (1, 1, 2, 2):
        t.observe(w, [], 1.0)
    for _ in range(10):
        t.observe_shadow([[4, 5, 6]])
    assert round(t.accepted[4], 3) == 1.0 and t.accepted[8] > 3
    assert t.choose() == 8


@pytest.mark.parametrize("batched", [False, True])
def test_a_step_drafting_fewer_nodes_than_its_width_is_timed_as_the_narrower_width(batched):
    """A drafter with nothing to propose on one step in three (n-gram on sampled text): those wider steps verify the
    root alone, at plain AR's cost. Counted as the width's, its minimum made drafting look free and 1.33 tokens a step
    (shadow tries) beat AR's one (seen at 0.81x AR); timed as what they verified, wider steps cost 1.4 and AR wins."""
    t = WidthTuner(4)
    w, wide = t.choose(), 0
    for k in range(600):
        nodes = w if k % 3 else 1  # the drafter proposes on two steps in three
        path = [1] if nodes > 1 and k % 6 == 1 else []
        seconds = 1.0 if nodes == 1 else 1.4
        if batched:
            t.observe_batch(w, [path, []], seconds, (nodes + 1) / 2)  # the other sequence never drafts
        else:
            t.observe(w, path, seconds, nodes)
        if k % 16 == 0:  # shadow tries: one draft accepted in three steps
            t.observe_shadow([[1] if k % 48 == 0 else []])
        w = t.choose()
        wide += k >= 300 and w > 1
    assert wide <= 2, (wide, t.accepted, t.cost)  # plain AR but for its (rare, once shadowed) exploring steps
    assert t.cost[1] == 1.0 and set(t.cost) > {1} and all(t.cost[v] == 1.4 for v in t.cost if v > 1)


def test_a_batch_step_is_one_observation_of_its_mean_acceptance():
    """8 sequences, one of which accepted a draft: the batch's 1.125 tokens per sequence moves the estimate once, as
    one sequence's step would (8 separate observations would weigh that one hit 8 times over)."""
    batched, solo = WidthTuner(2), WidthTuner(2)
    for _ in range(100):
        batched.observe_batch(2, [[]] * 8, 1.0)
        solo.observe(2, [], 1.0)
    batched.observe_batch(2, [[1]] + [[]] * 7, 1.0)
    solo.observe(2, [], 1.0)
    assert batched.accepted[2] - solo.accepted[2] == pytest.approx(EMA * 0.125)
    apart = WidthTuner(2)  # the same 8 sequences fed as 8 observations: the hit weighs 8 times over
    for _ in range(100):
        apart.observe(2, [], 1.0)
    apart.observe(2, [1], 1.0)
    for _ in range(7):
        apart.observe(2, [], 1.0)
    assert apart.accepted[2] - solo.accepted[2] > 2 * (batched.accepted[2] - solo.accepted[2])  # ~3.8x at EMA 0.1


def test_starts_with_plain_steps_and_falls_back_to_width_1_fast_when_drafts_miss():
    t = WidthTuner(64)
    assert t.choose() == 1  # nothing measured: time width 1 first
    t.observe(1, [], 1.0)
    assert t.choose() == 1  # and again: a first step pays one-off set-up
    t.observe(1, [], 1.0)
    w = t.choose()
    assert w > 1  # optimistic about drafting until measured
    picks = []
    for _ in range(30):  # every draft misses; wider steps cost 1.3x
        t.observe(w, [], 1.0 if w == 1 else 1.3)
        w = t.choose()
        picks.append(w)
    assert picks[-28:] == [1] * 28, picks  # back to AR at once: the first observation replaces the optimistic prior
    explored = [t.choose() for _ in range(EXPLORE_EVERY_AR)]
    assert explored.count(1) == EXPLORE_EVERY_AR - 1  # then one wider step in EXPLORE_EVERY_AR


def test_the_hold_never_keeps_a_width_against_plain_ar_once_drafts_miss():
    """Drafts hit, then every one misses, and a wider step costs only 5% more than a plain one (under the stay
    margin): the width in use is not held against plain AR, which takes over once the acceptance estimate (an EMA
    from ~3 tokens) says drafting no longer pays, ~35 steps, as it did before the hold (held, it never did)."""
    t = WidthTuner(8)
    picks = []
    for step in range(400):
        w = t.choose()
        hit = step < 200
        t.observe(w, list(range(1, min(w, 4))) if hit else [], 1.0 if w == 1 else 1.05)
        if not hit:
            picks.append(w)
    first = picks.index(1)
    assert first <= 40 and sum(w > 1 for w in picks[first:]) <= 4, picks  # after it only AR's rare exploring steps


@pytest.mark.parametrize("slow_steps", [1, 2])
def test_a_cold_first_step_does_not_keep_a_width_out(slow_steps):
    """Width 1's first step paid one-off set-up (57 against 34 ms): it is timed again, and re-timed every
    EXPLORE_EVERY_AR steps while a wider width wins (a slow spell over both first steps), so a stale cost cannot keep
    the tuner on drafts that are never accepted (seen on smollm2, 8 sampled sequences: ~100 steps at widths 2-4)."""
    true_cost = {1: 34.0, 2: 45.0, 4: 46.0, 8: 83.0}
    t = WidthTuner(8)
    picks = []
    for _ in range(EXPLORE_EVERY_AR + 20):
        w = t.choose()
        picks.append(w)
        t.observe(w, [], 57.0 if w == 1 and picks.count(1) <= slow_steps else true_cost[w])  # drafts never accepted
    assert picks[:2] == [1, 1] and picks[-20:].count(1) >= 18, picks  # at most one exploring pair among them


def test_exploring_backs_off_while_drafts_keep_missing():
    """Sampled text: every wider step costs 1.3x and finds nothing; the gaps between them double up to a cap."""
    t = WidthTuner(8)
    wider = []
    for step in range(1, 1100):
        w = t.choose()
        t.observe(w, [], 1.0 if w == 1 else 1.3)
        if w > 1 and step > 20 and step - 1 not in wider:  # after the first timings; a width explored for the
            wider.append(step)  # first time is timed twice in a row (its first step pays one-off set-up): one episode
    gaps = [b - a for a, b in zip(wider, wider[1:])]
    assert gaps[:3] == [EXPLORE_EVERY_AR, 2 * EXPLORE_EVERY_AR, EXPLORE_MAX_AR] and set(gaps[2:]) == {EXPLORE_MAX_AR}


def test_slow_outliers_do_not_make_a_width_look_expensive():
    t = WidthTuner(2)
    t.observe(1, [], 5.0)  # a one-off set-up cost (a new shape)
    t.observe(1, [], 1.0)
    t.observe(1, [], 9.0)  # another process took the core for a while
    assert t.cost[1] == 1.0
    for _ in range(COST_WINDOW):  # but a lasting change (a longer context) is followed
        t.observe(1, [], 2.0)
    assert t.cost[1] == 2.0


def test_adaptive_width_changes_nothing_in_the_output(load_fixture):
    lm = load_fixture("llama_gqa")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat")
    params = SamplingParams(max_tokens=300, temperature=0.8, min_p=0.05, seed=9, ignore_eos=True)
    ref = Engine(lm, EngineConfig(drafters=())).generate(prompt, params).token_ids
    engine = Engine(lm, EngineConfig(trie_budget=32))
    assert engine.generate(prompt, params).token_ids == ref
    assert engine.tuner is not None and len(engine.tuner.cost) >= 2  # several widths were timed


def test_narrow_steps_do_not_wear_down_wider_widths_that_shadows_measure():
    """A drafter whose deeper nodes pay: steps at width 2 see at most one drafted token, shadows of the full trie see
    three. Once shadows come in, the narrow steps' lower bound no longer drags the wider estimates down to width 2's."""
    t = WidthTuner(8)
    t.observe_shadow([[1, 2, 3]])  # the full trie accepted three drafted nodes
    for _ in range(50):
        t.observe(2, [1], 1.0)  # width 2 accepts its one drafted node every time
    assert t.accepted[2] == pytest.approx(2.0, abs=0.05)
    assert t.accepted[8] > 3.0  # the prior (4) and the shadow (4 tokens), untouched by width 2's bound of 2
    unshadowed = WidthTuner(8)
    for _ in range(50):
        unshadowed.observe(2, [1], 1.0)
    assert unshadowed.accepted[8] == pytest.approx(2.0, abs=0.05)  # without shadows the bound is all it knows


@pytest.mark.parametrize("hits", [1.0, 0.5])
def test_without_narrow_bounds_wider_widths_learn_only_from_their_own_steps(hits):
    """The 4-bit self-draft's tuner (narrow_bounds off): width 2's steps, whether they fill their width or miss, leave
    width 4's measured 3 tokens alone, and width 4 wins (3 per 2.5 s against 3 per 2.6 s at width 3, 2 per 2 s, 1 per
    1 s)."""
    t = WidthTuner(4, narrow_bounds=False)
    t.observe(1, [], 1.0)
    t.observe(1, [], 1.0)
    for _ in range(3):
        t.observe(2, [1], 2.0)
        t.observe(3, [1, 2], 2.6)
    for _ in range(10):
        t.observe(4, [1, 2], 2.5)  # 3 tokens (path of 2 drafted, the width's third node missed)
    for i in range(50):
        t.observe(2, [1] if (i % 2 == 0 or hits == 1.0) else [], 2.0)
    assert t.accepted[4] == pytest.approx(3.0, abs=0.05)
    assert t.choose() == 4


def test_the_first_shadow_replaces_the_lower_bounds_narrow_steps_left_on_wider_widths():
    """Before any shadow, width-2 steps that missed wear every wider estimate down to ~1 token (a bound, not a
    measurement); the first shadow's exact acceptance replaces that, so a passage that starts repeating is seen
    at once, not after ~1/EMA shadows (a looping text spent most of a 256-token generation at width 1)."""
    t = WidthTuner(8)
    for _ in range(30):
        t.observe(2, [], 1.0)  # width 2's drafted node missed: every width's estimate falls towards 1 token
    assert t.accepted[8] < 1.1
    t.observe_shadow([[1, 2, 3, 4, 5, 6, 7]])  # the full trie would have accepted 7 drafted tokens
    assert t.accepted[8] == pytest.approx(8.0) and t.accepted[4] == pytest.approx(4.0)
    t.observe_shadow([[1, 2, 3]])  # later shadows average in as before
    assert t.accepted[8] == pytest.approx(6.0)



def _chain(t: WidthTuner, w: int, accepted: int, seconds: float) -> None:
    t.observe(w, list(range(1, accepted + 1)), seconds, w)


def test_a_chain_width_is_costed_against_the_width_in_use_side_by_side():
    """Width 8 timed beside width 6 (8 s to 6 s); the host then slows by half while 6 is in use: 8's cost follows 6's
    (its own minimum stays at 8 s), plain AR's too. A width's first step (its set-up) is no chain width's cost."""
    t = WidthTuner(16, narrow_bounds=False, chain=16)
    for w, s in ((1, 9.0), (6, 60.0), (8, 80.0), (6, 6.0), (6, 6.0), (1, 4.0), (6, 6.0), (8, 8.0)):
        _chain(t, w, w - 1, s)
    assert t.chain_costs(6) == pytest.approx({6: 6.0, 8: 8.0, 1: 4.0})
    for _ in range(16):
        _chain(t, 6, 5, 12.0)
    assert t.cost[8] == 8.0  # what the case is about: a minimum per width keeps the quiet spell's
    assert t.chain_costs(6) == pytest.approx({6: 12.0, 8: 16.0, 1: 8.0})
    assert t.chain_costs(8) == {}  # not stepped lately: nothing to pair with


def test_a_width_explored_after_a_gap_stands_for_the_steps_since():
    """Width 8 is verified every EXPLORE_EVERY steps only: one observation then moves its ratio to width 6 as
    EXPLORE_EVERY of them would (a ratio pulled to ~1 by a hard passage otherwise took ~500 steps to recover)."""
    t = WidthTuner(16, narrow_bounds=False, chain=16)
    for _ in range(40):
        t.step += 1
        _chain(t, 8, 7, 8.0)  # both widths accept their whole chain: 8 tokens to 6
    for _ in range(200):
        t.step += 1
        _chain(t, 8, 3, 8.0)  # a hard passage: both accept 3 drafted tokens
    assert t.acceptance.pair[8][0] / t.acceptance.pair[8][1] == pytest.approx(1.0, abs=0.01)
    t.step += EXPLORE_EVERY
    _chain(t, 8, 7, 8.0)  # easy again, 8 verified once after a gap
    ratio = t.acceptance.pair[8][0] / t.acceptance.pair[8][1]
    assert ratio > 1.1  # at CHAIN_EMA alone: ~1.01


def test_a_hard_passage_does_not_make_the_next_wider_chain_width_look_better():
    """Width 6 in use, 8 explored now and then (7 tokens to 6 on the same steps), then a hard passage. Width 8's own
    mean is of its few steps before it; judged by its ratio to width 6 on the steps that verified both, it stays behind,
    and the narrow widths that the hard passage favours win."""
    t = WidthTuner(16, narrow_bounds=False, chain=16)
    cost = {w: w + 3.0 for w in t.widths}
    cost[1] = 4.5
    for w in (1, 1, 2, 2, 3, 3, 4, 4):
        _chain(t, w, w - 1, cost[w])
    for k in range(200):
        _chain(t, 8, 6, cost[8]) if k % EXPLORE_EVERY == 0 else _chain(t, 6, 5, cost[6])
    t._held = t.widths.index(6)
    assert t.choose() == 6
    for _ in range(60):
        _chain(t, 6, 1, cost[6])  # a hard passage: one drafted token accepted of five
    assert t.accepted[8] / t.cost[8] > 2 * t.accepted[6] / t.cost[6]  # what the case is about: 8's own mean is stale
    assert t.chain_accepted()[8] == pytest.approx(t.accepted[6] * 7 / 6)
    assert t.choose() == 2  # 2 tokens for 5 s: the best of what the hard passage accepts


@pytest.mark.skipif(cpu_kernels() is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")
def test_greedy_and_sampled_generations_tune_apart(tmp_path):
    """Only sampled text gets the chain tuner: greedy steps are mostly the n-gram copy's (free drafts of the whole
    width), which judging widths by the chain's own steps missed (3.6 against 2.9x AR with the copy counted)."""
    lm = load_model(str(build_tiny_model(tmp_path / "llama", hidden=128, heads=4, kv_heads=2, layers=2, seed=5)),
                    dtype="bfloat16")
    assert "quant" in Engine(lm, EngineConfig()).names
    engine = Engine(lm, EngineConfig(trie_budget=16))
    for params in (SamplingParams(max_tokens=40, ignore_eos=True),
                   SamplingParams(max_tokens=40, temperature=1.0, seed=1, ignore_eos=True)):
        engine.generate([5, 6, 7, 8], params)
        assert engine.tuner.chain == (0 if params.greedy else 16) and engine.tuner.step > 0
