"""Shadow tries: a trie drafted at a plain AR step, walked over AR's later tokens, is the path its verify accepts."""

import pytest

import specrun.decoding.step as step_mod
from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.trie import Draft, build_trie
from specrun.decoding.width.explore import EXPLORE_MAX_AR, EXPLORE_MAX_SHADOWED
from specrun.decoding.width.shadow import SHADOW_EVERY, SHADOW_SOON, SHADOW_SOON_PATH, Shadow, shadowable
from specrun.decoding.width.tuner import WidthTuner


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resolved_shadow_is_the_path_the_verify_of_that_trie_accepted(load_fixture, monkeypatch, temperature):
    """Every step of a fixed-width speculative run, replayed as a shadow over the final output, gives that step's path."""
    lm = load_fixture("llama_gqa")
    steps = []  # (trie, accepted nodes beyond the root)

    def recording_walk(trie, choice):
        path = walk(trie, choice)
        steps.append((trie, path.tolist()[1:]))
        return path

    walk = step_mod.walk
    monkeypatch.setattr(step_mod, "walk", recording_walk)
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat sat on the mat. the cat")
    params = SamplingParams(max_tokens=120, temperature=temperature, min_p=0.05, seed=3, ignore_eos=True)
    # shadow tries are for tree drafters (the 4-bit chain drafts by forwards: no shadows)
    config = EngineConfig(drafters=("ngram", "recycling"), trie_budget=16, adaptive_budget=False)
    out = Engine(lm, config).generate(prompt, params).token_ids
    n, checked, hits = 0, 0, 0
    for trie, path in steps:
        shadow = Shadow()
        shadow.take(trie, n)
        if n + int(trie.depths.max()) <= len(out) - 1:  # the run did not end inside this trie
            assert shadow.resolve(out) == path
            checked += 1
            hits += bool(path)
        n += len(path) + 1
    assert checked > 20 and hits > 0  # drafts were accepted on some steps, so paths of several lengths were compared


def test_a_shadow_waits_for_the_tokens_under_its_deepest_node():
    # root 5, chains 5 -> 7 -> 8 and 5 -> 9: needs AR's next two tokens
    trie = build_trie(5, [Draft([5, 7, 8], [-1, 0, 1], 0), Draft([5, 9], [-1, 0], 1)], 8, "cpu")
    shadow = Shadow()
    shadow.take(trie, 3)
    assert shadow.resolve([0, 1, 2, 7]) is None
    assert shadow.resolve([0, 1, 2, 7, 8]) == [1, 2]  # both chain nodes; the bonus token comes after
    shadow.take(trie, 3)
    assert shadow.resolve([0, 1, 2, 9, 4]) == [3]
    assert shadow.resolve([0, 1, 2, 9, 4]) is None  # resolved once


def test_shadows_are_taken_every_so_many_plain_steps_one_at_a_time():
    trie = build_trie(5, [Draft([5, 7], [-1, 0], 0)], 8, "cpu")
    shadow, taken = Shadow(), []
    out = []
    for step in range(4 * SHADOW_EVERY):
        if shadow.due():
            shadow.take(trie, len(out))
            taken.append(step)
        out.append(step)
        shadow.resolve(out)
    assert taken == [SHADOW_EVERY * k for k in range(4)]
    assert shadowable(("ngram", "recycling")) and not shadowable(("heads", "ngram")) and not shadowable(())


@pytest.mark.parametrize("hits", [True, False])
def test_a_shadow_that_accepted_drafts_brings_the_next_one_sooner(hits):
    """A repeating text: the chain 5 -> 7 -> 7 -> 7 is what AR emits at every step (3 drafted tokens accepted), or
    never is; a shadow resolves 2 steps after it is taken (its deepest node needs 3 tokens)."""
    assert SHADOW_SOON < SHADOW_EVERY and SHADOW_SOON_PATH <= 3
    trie = build_trie(5, [Draft([5, 7, 7, 7], [-1, 0, 1, 2], 0)], 8, "cpu")
    shadow, taken, out = Shadow(), [], []
    for step in range(40):
        if shadow.due():
            shadow.take(trie, len(out))
            taken.append(step)
        out.append(7 if hits else 0)
        shadow.resolve(out)
    gap = 2 + (SHADOW_SOON if hits else SHADOW_EVERY)
    assert taken == list(range(0, 40, gap))


def _ar_wins(t: WidthTuner) -> None:
    for w, c in ((1, 1.0), (2, 1.05), (4, 1.1), (8, 1.2)):
        for _ in range(50):
            t.observe(w, [], c)
    assert t.choose() == 1


def test_shadow_hits_take_the_tuner_off_plain_ar_without_an_exploring_step():
    t = WidthTuner(8)
    _ar_wins(t)
    cost = dict(t.cost)
    for _ in range(5):
        t.observe_shadow([[1, 3, 6], [1]])  # two sequences: 3 and 1 drafts accepted, mean 3 tokens at width 8
    assert t.cost == cost  # acceptance only: a shadow costs no verify time
    assert t.choose() > 1


def test_with_shadows_exploring_backs_off_further():
    """Sampled text: shadows keep finding nothing, so wider steps come at gaps up to the shadowed cap."""
    t = WidthTuner(8)
    _ar_wins(t)
    wider = []
    for step in range(1, 6000):
        w = t.choose()
        t.observe(w, [], 1.0 if w == 1 else 1.3)
        if step % SHADOW_EVERY == 0:
            t.observe_shadow([[]])
        if w > 1:
            wider.append(step)
    gaps = [b - a for a, b in zip(wider, wider[1:])]
    assert max(gaps) == EXPLORE_MAX_SHADOWED > EXPLORE_MAX_AR
