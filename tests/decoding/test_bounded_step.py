"""I5 bounded step cost: outside the model forward, no step does work that grows with the generated length."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specrun.decoding.engine import Engine, EngineConfig
from specrun.decoding.verify.params import SamplingParams


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
    full = EngineConfig().trie_budget
    for n, big, total in steps[100:]:  # step n emitted token n; it penalised the window before it
        if PARAMS.max_tokens - n < full:  # the last steps' width shrinks to the tokens left: less work, not more
            continue
        distinct = len(set(seen[: len(prompt) + n - 1][-W:]))
        work.setdefault(distinct, set()).add((big, total))
    assert len(work) > 1  # the window's content varies, so the grouping is exercised
    assert all(len(shapes) == 1 for shapes in work.values()), work


@pytest.mark.parametrize("drafters", [("ngram",), ("ngram", "recycling")])
def test_drafting_steps_of_the_same_trie_do_identical_work_at_any_length(load_fixture, drafters, monkeypatch):
    """Greedy, so a step's tensors are set by its trie (size, depth) and what it accepted: steps alike in those do
    the same work early and late in a 1,200-token generation; a pass over the history would make late ones larger."""
    from specrun.decoding import engine as engine_module

    tries = []
    build = engine_module.build_trie

    def recording(*args, **kwargs):
        trie = build(*args, **kwargs)
        tries.append((trie.size, trie.path_tokens.shape[1]))
        return trie

    monkeypatch.setattr(engine_module, "build_trie", recording)
    lm = load_fixture("llama_gqa", dtype="float32")
    engine = Engine(lm, EngineConfig(drafters=drafters, adaptive_budget=False))
    params = SamplingParams(max_tokens=1200, ignore_eos=True)
    steps = per_step_sizes(engine, lm.tokenizer.encode("the cat sat on the mat. the cat"), params)
    assert steps[-1][0] == params.max_tokens and len(tries) == len(steps)
    by_kind = {}
    for i in range(1, len(steps)):
        n, big, total = steps[i]
        by_kind.setdefault((*tries[i], n - steps[i - 1][0]), []).append((n, big, total))  # trie size, depth, emitted
    early_late = {k: ([r for r in rows if r[0] < 400], [r for r in rows if r[0] > 800]) for k, rows in by_kind.items()}
    early_late = {k: v for k, v in early_late.items() if v[0] and v[1]}
    assert early_late  # some kinds of step occur both early and late: the comparison is exercised
    for kind, (early, late) in early_late.items():
        # the recycling matrix's update varies with the text (tens to a few hundred elements); a tensor over the
        # history would add 800 or more to every late step
        assert max(r[2] for r in late) - min(r[2] for r in early) < 400, (kind, early, late)
        assert max(r[1] for r in late) <= max(r[1] for r in early), (kind, early, late)
