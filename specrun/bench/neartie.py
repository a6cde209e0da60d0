"""Near-tie check (docs/design.md section 2): where a run's tokens first differ from AR, were the two tokens a
numerical tie?

check_divergence recomputes AR's processed scores (noise included when sampling) at the first differing position.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specrun.decoding.forward.runner import ModelRunner
from specrun.decoding.verify.params import SamplingParams
from specrun.decoding.verify.penalty import PenaltyWindow
from specrun.decoding.verify.sampling import apply_penalty, gumbel_noise, truncate

# How far a row-count change moves logits: smollm2 on CPU, the same positions computed in 1-row (AR) forwards and in
# 2-64-row causal forwards, 160 generated tokens: max |dlogit| bf16 1.0 (13 argmax flips),
# float32 7e-5 (no flips). A gap is a difference of two such logits, so the tolerance is twice the measured max;
# float16 scaled from bf16 by its 3 extra mantissa bits. In logit units (divided by the temperature when sampling).
LOGIT_TOLERANCE = {torch.bfloat16: 2.0, torch.float16: 0.25, torch.float32: 2e-4, torch.float64: 1e-9}


@dataclass(frozen=True)
class Divergence:
    first_diff: int  # index (in generated tokens) of the first token that differs from the reference
    reference_token: int
    other_token: int
    gap: float  # AR's score(reference_token) - score(other_token) there: processed logits (+ noise when sampling)
    tolerance: float
    near_tie: bool

    def as_dict(self) -> dict:
        return asdict(self)


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tolerance(dtype: torch.dtype, params: SamplingParams) -> float:
    return LOGIT_TOLERANCE[dtype] / (1.0 if params.greedy else params.temperature)


def ar_scores(lm, prompt_ids: list[int], generated: list[int], params: SamplingParams,
              prefill_chunk: int = 256, compiled: bool = False) -> torch.Tensor:
    """AR's scores for the token after prompt + generated: what AR takes the argmax of there (compiled: AR ran
    through the decoder's compiled layers, which differ from the eager ones in the last bits).

    # -> [V] float64 (processed logits, plus Gumbel noise at position len(prompt)+len(generated) when sampling)
    """
    untruncated, noise = _ar_row(lm, prompt_ids, generated, params, prefill_chunk, compiled)
    return _scores(untruncated, noise, params)


def _ar_row(lm, prompt_ids, generated, params, prefill_chunk,
            compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AR's logits there after penalty and temperature (before truncation), and the noise when sampling.

    Replays AR's own forwards (chunked prefill of the prompt, then one row per generated token) so that in reduced
    precision the scores are AR's bit for bit; costs one forward per generated token.
    # -> [V] float64, [V] float64 or None
    """
    context = [*prompt_ids, *generated]
    n, dev = len(context), lm.device
    runner = ModelRunner(lm, max_rows=prefill_chunk)
    runner.compiled = compiled  # the packages AR ran are the decoder's, loaded (a forward they do not cover: eager)
    runner.reset(n + 1)
    seq = torch.tensor(context, dtype=torch.long, device=dev)
    runner.prefill(seq[: len(prompt_ids) - 1], prefill_chunk)
    one = torch.ones((1, 1), dtype=torch.bool, device=dev)
    for p in range(len(prompt_ids) - 1, n):  # the root of each AR step
        hidden = runner.forward(seq[p : p + 1], torch.tensor([p], device=dev), one)
        runner.cache.append(1)
    logits = runner.logits(hidden)
    present = None
    if params.uses_penalty:
        window = PenaltyWindow(logits.shape[-1], params.penalty_window, dev)
        window.reset(seq, n)
        present = (window.counts > 0)[None]
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()  # as process_logits computes
    if present is not None:
        x = apply_penalty(x, present, params.penalty)
    if params.greedy:
        return x[0], None
    return (x / params.temperature)[0], gumbel_noise(params.seed, torch.tensor([n], device=dev), x.shape[-1])[0]


def _scores(untruncated: torch.Tensor, noise: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """# untruncated: [V] (AR's dtype), noise: [V] or None -> [V] float64: truncation, then the noise"""
    if noise is None:
        return untruncated.to(torch.float64)
    return truncate(untruncated[None], params)[0].to(torch.float64) + noise.to(torch.float64)


def _truncation_gap(untruncated, noise, params, ref: int, other: int, tol: float) -> float:
    """`other` was cut by truncation in AR: how far its logit is from being kept (the least raise that keeps it, found
    by bisection up to tol) plus how far it then is below AR's token. inf when no raise up to tol keeps it."""
    def with_raise(d: float) -> torch.Tensor:
        x = untruncated.clone()
        x[other] += d
        return _scores(x, noise, params)

    if with_raise(tol)[other] == float("-inf"):
        return float("inf")
    lo, hi = 0.0, tol
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if with_raise(mid)[other] > float("-inf") else (mid, hi)
    scores = with_raise(hi)
    return hi + max(0.0, float(scores[ref] - scores[other]))


def check_divergence(lm, prompt_ids: list[int], params: SamplingParams, reference: list[int], other: list[int],
                     prefill_chunk: int = 256, compiled: bool = False) -> Divergence | None:
    """None when `other` equals `reference` (AR's tokens; compiled: AR ran through the compiled layers); else the
    first divergence and whether it is a near tie."""
    i = first_diff(other, reference)
    if i is None:
        return None
    tol = tolerance(lm.dtype, params)
    if i >= len(other) or i >= len(reference):  # one stopped early: not a tie between two tokens
        return Divergence(i, reference[i] if i < len(reference) else -1, other[i] if i < len(other) else -1,
                          float("inf"), tol, False)
    untruncated, noise = _ar_row(lm, prompt_ids, reference[:i], params, prefill_chunk, compiled)
    scores = _scores(untruncated, noise, params)
    gap = float(scores[reference[i]] - scores[other[i]])
    if scores[other[i]] == float("-inf"):  # reduced precision moved it across the truncation boundary (min-p, ...)?
        gap = _truncation_gap(untruncated, noise, params, reference[i], other[i], tol)
    elif scores[reference[i]] == float("-inf"):  # a reference that is not AR's run (a bench's first repeat) crossed it
        gap = -_truncation_gap(untruncated, noise, params, other[i], reference[i], tol)
    return Divergence(i, reference[i], other[i], gap, tol, abs(gap) <= tol)
