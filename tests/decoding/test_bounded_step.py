"""I5 bounded step cost: outside the model forward, no step does work that grows with the generated length."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.sampling import SamplingParams


class OutputSizes(TorchDispatchMode):
    """Elements produced by torch ops while `active`: the largest tensor and the total."""

    def __init__(self):
        super().__init__()
        self.active, self.largest, self.total = True, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
                    self.total += t.numel()
        return out


def per_step_sizes(engine, prompt, params, emitted=None):
    """[(tokens so far, largest tensor, total elements)] per step, the model forward itself not watched; the tokens go
    to `emitted` (a list) when given."""
    forward = engine.runner.forward
    spy = OutputSizes()

    def forward_unwatched(*args, **kwargs):  # attention over the whole cache is the one cost allowed to grow
        spy.active = False
        try:
            return forward(*args, **kwargs)
        finally:
            spy.active = True

    engine.runner.forward = forward_unwatched
    steps, done = [], [0]

    def on_step(tokens):
        done[0] += len(tokens)
        if emitted is not None:
            emitted.extend(tokens)
        steps.append((done[0], spy.largest, spy.total))
        spy.largest = spy.total = 0
        return False

    with spy:
        engine.generate(prompt, params, on_step=on_step)
    return steps


PARAMS = SamplingParams(max_tokens=1200, temperature=0.9, min_p=0.02, penalty=1.2, penalty_window=64, seed=1,
                        ignore_eos=True)


def test_ar_steps_do_identical_work_at_any_length(load_fixture):
    lm = load_fixture("llama_gqa", dtype="float32")
    prompt = lm.tokenizer.encode("the cat sat on the mat. the cat")
    out = []
    steps = per_step_sizes(Engine(lm, EngineConfig(drafters=())), prompt, PARAMS, out)
    # once the penalty window is full, AR steps whose window holds as many distinct tokens (the penalty touches those
    # alone) have the same shapes at any length: any rescan of the output would show
    seen, W = prompt + out, PARAMS.penalty_window
    work = {}
    for n, big, total in steps[100:]:  # step n emitted token n; it penalised the window before it
        distinct = len(set(seen[: len(prompt) + n - 1][-W:]))
        work.setdefault(distinct, set()).add((big, total))
    assert len(work) > 1  # the window's content varies, so the grouping is exercised
    assert all(len(shapes) == 1 for shapes in work.values()), work


@pytest.mark.parametrize("drafters", [("ngram",), ("ngram", "recycling")])
def test_drafting_step_tensors_are_bounded_by_trie_and_vocabulary(load_fixture, drafters):
    lm = load_fixture("llama_gqa", dtype="float32")
    engine = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False))
    steps = per_step_sizes(engine, lm.tokenizer.encode("the cat sat on the mat. the cat"), PARAMS)
    assert steps[-1][0] == PARAMS.max_tokens
    # trie sizes vary step to step, so the bound is the trie budget x vocabulary, whatever the length
    assert max(big for _, big, _ in steps[1:]) <= 64 * engine.vocab_size * 2  # step 1 also counts buffer set-up
