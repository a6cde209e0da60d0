"""The bench's HF generate baseline: an explicit GenerationConfig for specrun's sampling settings, run on its own model
copy and timed per generated length; hf_notes says where HF cannot sample exactly as specrun does."""

from __future__ import annotations

import time

import torch

from specrun.bench.clock import LengthClock, sync
from specrun.decoding.verify.params import SamplingParams


def hf_notes(params: SamplingParams, prompt_len: int) -> list[str]:
    """Where HF generate cannot run exactly the same sampling as specrun."""
    notes = ["hf_*: EOS is masked until max_tokens (min_new_tokens); specrun runs with ignore_eos (EOS is an ordinary "
             "token), so HF text may differ where the model would pick EOS"]
    if params.penalty != 1.0 and params.penalty_window < prompt_len + params.max_tokens:
        notes.append(f"hf_*: not comparable: HF repetition_penalty covers the whole context, specrun only the last "
                     f"{params.penalty_window} tokens")
    if not params.greedy:
        notes.append("hf_*: sampled with torch's RNG (specrun uses counter-based Gumbel noise): same distribution, "
                     "different tokens")
    return notes


def hf_generation_config(params: SamplingParams, n: int, eos_ids, pad_id: int | None, extra: dict):
    """An explicit GenerationConfig (model defaults such as a shipped temperature are not inherited)."""
    from transformers import GenerationConfig

    eos = sorted(eos_ids)
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=not params.greedy, num_beams=1,
              eos_token_id=eos or None, pad_token_id=pad_id if pad_id is not None else (eos[0] if eos else None),
              repetition_penalty=params.penalty, use_cache=True, **extra)
    if not params.greedy:
        kw.update(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                  min_p=params.min_p or None, eta_cutoff=params.eta)
    return GenerationConfig(**kw)


class _HFStreamer:
    """transformers streamer protocol: put() is called with the prompt first, then with each new token chunk."""

    def __init__(self, clock: LengthClock, t0: float):
        self.clock, self.t0, self.seen_prompt = clock, t0, False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.clock.add(int(value.numel()), time.perf_counter() - self.t0)

    def end(self) -> None:
        pass


def run_hf(hf_lm, prompt_ids: list[int], params: SamplingParams, n: int, extra: dict, lengths=()) -> tuple[list[int], float, dict]:
    """HF generate on its own model copy -> (new token ids, seconds, {length: seconds})."""
    pad = getattr(hf_lm.tokenizer, "pad_token_id", None)
    gcfg = hf_generation_config(params, n, hf_lm.eos_ids, pad, extra)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=hf_lm.device)
    torch.manual_seed(params.seed)
    sync(hf_lm.device)
    t0 = time.perf_counter()
    clock = LengthClock(tuple(lengths))
    with torch.inference_mode():
        out = hf_lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gcfg,
                                   streamer=_HFStreamer(clock, t0) if lengths else None)
    sync(hf_lm.device)
    seconds = time.perf_counter() - t0
    return out[0, len(prompt_ids):].tolist(), seconds, clock.at
