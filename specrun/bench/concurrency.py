"""Aggregate throughput with N different prompts in flight on one worker: AR and speculative, batched, side by side.

run_concurrency(...) -> one dict per timed run (name, concurrency, tokens_per_s, what ran compiled, ...); each sequence's
tokens are compared with the same prompt's AR output at the lowest concurrency: equal, or differing first at a reported
near tie. compile_notes(rows, configs) says which runs went without a compile that auto left out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from specrun.bench.neartie import check_divergence
from specrun.decoding.config import COMPILE_DRAFT_TOKENS, COMPILE_LAYERS_TOKENS
from specrun.decoding.drafters.quant_draft import compilable
from specrun.decoding.engine import BatchConfig, Engine, EngineConfig
from specrun.decoding.forward.decoder import FusedDecoder
from specrun.decoding.forward.paged_attention import resolve_backend
from specrun.decoding.verify.params import SamplingParams

REFERENCE = "specrun_ar"  # the run kind whose lowest-concurrency tokens every other run is checked against


def prompt_variants(text: str, n: int) -> list[str]:
    """n different prompts from one: the text, then the text asking for another take (different tokens, same task)."""
    return [text if i == 0 else f"{text} (Take {i + 1}: tell it differently.)" for i in range(n)]


def run_concurrency(lm, prompts: list[list[int]], params: SamplingParams, levels: tuple[int, ...],
                    configs: dict[str, EngineConfig], repeat: int = 1, backend: str = "auto",
                    log: Callable[[str], None] = lambda m: None, lockstep: bool = True) -> list[dict]:
    """Every (config, level) `repeat` times, interleaved; level c runs prompts[:c] at once (EOS ignored, no stops).
    lockstep: a level's configs take turns a step each (_lockstep), else whole runs one after another."""
    params = dataclasses.replace(params, ignore_eos=True, stop=(), stop_token_ids=())
    need = max(len(p) for p in prompts) + params.max_tokens + max(c.trie_budget for c in configs.values()) + 1
    backend = resolve_backend(backend, lm.dtype, lm.device, FusedDecoder.of(lm.model).head_dim)
    page = need if lm.device.type == "cpu" and backend in ("sdpa", "dense") else 16  # as the job driver pages

    def engine(config: EngineConfig, c: int) -> Engine:
        return Engine(lm, config, BatchConfig(concurrency=c, kv_tokens=c * need, page_size=page, backend=backend))

    # (level, the configs run together): all of a level's in lockstep, else one each
    groups = [(c, list(configs)) for c in levels] if lockstep else [(c, [name]) for c in levels for name in configs]
    outputs: list[dict[int, list[int]]] = []  # per row: each prompt's tokens
    out = []
    for r in range(repeat):
        k = r % len(groups)
        for c, names in groups[k:] + groups[:k]:
            batches = {name: engine(configs[name], c) for name in names}
            for batch in batches.values():  # its c admits' total: compiling is not timed
                batch.prepare(dataclasses.replace(params, max_tokens=c * params.max_tokens))
            compiles = {name: _compiles(batch) for name, batch in batches.items()}
            timed = _lockstep(batches, [(i, prompts[i], params, []) for i in range(c)])
            for name, (seconds, results) in timed.items():
                row = {**_row(name, c, r, seconds, results), **compiles[name]}
                log(f"repeat {r + 1}/{repeat} {name} concurrency {c}: {row['tokens']} tokens, "
                    f"{row['tokens_per_s']:.1f} tok/s, {row['mean_accepted']:.2f} accepted/step")
                out.append(row)
                outputs.append({i: res.token_ids for i, res in results.items()})

    def alone(i: int) -> tuple[list[int], bool]:  # AR of prompt i with nothing beside it; its layers compiled?
        log(f"AR reference for prompt {i}")
        ar = dataclasses.replace(next(iter(configs.values())), drafters=())
        result = engine(ar, 1).run([(i, prompts[i], params, [])])[i]
        return result.token_ids, bool(result.stats.get("compiled_layers"))

    _check_against_ar(lm, prompts, params, out, outputs, alone)
    return out


def _lockstep(batches: dict[str, Engine], requests: list) -> dict[str, tuple[float, dict]]:
    """Every engine runs all the requests (all admitted at once), the engines taking turns a step each, so a slow
    spell of a shared host falls on all alike; each is timed by its own admissions and steps. -> name: (seconds,
    key: GenerationResult)"""
    seconds, results = dict.fromkeys(batches, 0.0), {name: {} for name in batches}
    for name, batch in batches.items():
        t0 = time.perf_counter()
        for request in requests:
            if not batch.admit(*request):
                raise batch.too_big(f"request {request[0]!r}", *request[1:3])
        seconds[name] += time.perf_counter() - t0
    while any(batch.active for batch in batches.values()):
        for name, batch in batches.items():
            if batch.active:
                t0 = time.perf_counter()
                results[name].update(batch.step())
                seconds[name] += time.perf_counter() - t0
    return {name: (seconds[name], results[name]) for name in batches}


def _row(name: str, c: int, r: int, seconds: float, results: dict) -> dict:
    """One timed run's row (name, concurrency, repeat, tokens, seconds, tokens_per_s, mean_accepted, widths)."""
    tokens = sum(len(res.token_ids) for res in results.values())
    return {"name": name, "concurrency": c, "repeat": r, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "mean_accepted": sum(res.stats["mean_accepted"] for res in results.values()) / c,
            "widths": _merge_widths(res.stats.get("widths", {}) for res in results.values())}


def _compiles(batch: Engine) -> dict:
    """What an engine runs compiled once prepared: its layers (layers_compiled: None where compile_layers auto would
    never compile them here, or its packages ran slower than the eager layers here) and its quantized self-draft
    (quant_draft: "compiled"; "eager": torch's CPU draft uncompiled, qd.compilable; "kernels": a draft with no compile
    to leave out, our C kernels' or torch's on CUDA; None: no such drafter). compile_notes reads "eager" as
    Compiles.drafting does: several sequences leave it out."""
    from specrun.decoding.drafters.quant_ring import RingForward
    from specrun.decoding.forward.compiled import eligible

    quant, runner = batch.quant, batch.runner
    draft = None if quant is None else "compiled" if isinstance(quant, RingForward) else \
        "eager" if compilable(quant) else "kernels"
    dropped = runner.decoder.compiled is not None and runner.decoder.compiled.dropped  # CompiledLayers.keep_faster
    layers = True if runner.compiled else False if eligible(runner.decoder) and not dropped else None
    return {"layers_compiled": layers, "quant_draft": draft}


def compile_notes(rows: list[dict], configs: dict[str, EngineConfig]) -> list[str]:
    """What the reader of the rows must know about compiles that auto left out: a run of several sequences under
    compile_draft auto whose quantized self-draft stayed uncompiled ran without it (several sequences draft with it
    only compiled: decoding/compiles.py); layers that could compile ran eagerly."""
    notes = []
    no_draft = sorted({r["name"] for r in rows if r["concurrency"] > 1 and r.get("quant_draft") == "eager"
                       and configs[r["name"]].compile_draft == "auto"})
    if no_draft:
        notes.append(f"{', '.join(no_draft)} ran without the quantized self-draft at concurrency > 1: several "
                     f"sequences draft with it only compiled, no package of it is cached for this model, specrun and "
                     f"CPU, and runs asking under {COMPILE_DRAFT_TOKENS:,} tokens do not build one; --compile-draft on "
                     f"builds it once (a few minutes for smollm2), later runs load it in about a second")
    eager = sorted({r["name"] for r in rows if r.get("layers_compiled") is False})
    if eager:
        notes.append(f"{', '.join(eager)} ran the layers uncompiled: no package of them is cached here, and runs "
                     f"asking under {COMPILE_LAYERS_TOKENS:,} tokens do not build them; --compile-layers on builds "
                     f"them once (a few minutes), later runs load them")
    return notes


def _check_against_ar(lm, prompts, params, rows: list[dict], outputs: list[dict],
                      alone: Callable[[int], tuple[list[int], bool]]) -> None:
    """Adds identical_to_ar and divergences (first_diff, gap, near_tie per differing prompt) to every row. A prompt's
    reference is its AR run alone: the first AR run at concurrency 1 where there is one, else alone(i)."""
    reference: dict[int, tuple[list[int], bool]] = {}  # prompt: AR's tokens, whether its layers ran compiled
    for row, tokens in zip(rows, outputs):
        if row["name"] == REFERENCE and row["concurrency"] == 1:
            for i, toks in tokens.items():
                reference.setdefault(i, (toks, row.get("layers_compiled") is True))
    checked: dict = {}
    for row, tokens in zip(rows, outputs):
        row["divergences"] = []
        for i, toks in tokens.items():
            if i not in reference:
                reference[i] = alone(i)
            ref, compiled = reference[i]
            if toks == ref:
                continue
            key = (i, tuple(toks[: len(ref)]))
            if key not in checked:  # each distinct divergence replays AR once, through the layers it ran
                checked[key] = check_divergence(lm, prompts[i], params, ref, toks, compiled=compiled)
            row["divergences"].append({"prompt": i, **checked[key].as_dict()})
        row["identical_to_ar"] = not row["divergences"]
        row["lossless"] = all(d["near_tie"] for d in row["divergences"])


def _merge_widths(per_seq) -> dict[str, int]:
    total: dict[str, int] = {}
    for widths in per_seq:
        for w, n in widths.items():
            total[w] = total.get(w, 0) + n
    return total


def ar_of(name: str) -> str:
    """The AR run a run is measured against: compiled_spec's is compiled_ar, every other's specrun_ar."""
    return "compiled_ar" if name.startswith("compiled_") else "specrun_ar"


def summarize_concurrency(rows: list[dict]) -> list[dict]:
    """Per (name, concurrency): median tok/s over repeats, and ratios to concurrency 1 and to the AR run of its kind
    (ar_of) at the same level."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["name"], row["concurrency"]), []).append(row)
    table = []
    for (name, c), rs in groups.items():
        tps = sorted(r["tokens_per_s"] for r in rs)
        table.append({"name": name, "concurrency": c, "tokens_per_s": tps[len(tps) // 2],
                      "mean_accepted": sum(r["mean_accepted"] for r in rs) / len(rs),
                      "identical_to_ar": all(r.get("identical_to_ar", True) for r in rs),
                      "lossless": all(r.get("lossless", True) for r in rs)})
    by = {(t["name"], t["concurrency"]): t["tokens_per_s"] for t in table}
    low = min(t["concurrency"] for t in table)
    for t in table:
        t["vs_concurrency_1"] = t["tokens_per_s"] / by[(t["name"], low)]
        ar = by.get((ar_of(t["name"]), t["concurrency"]))
        t["vs_ar"] = t["tokens_per_s"] / ar if ar else None
    return sorted(table, key=lambda t: (t["concurrency"], t["name"]))
