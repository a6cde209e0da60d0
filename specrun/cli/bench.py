"""`specrun bench`: HF generate and specrun configurations side by side, interleaved and repeated, in one process.

Thin: parses flags into SamplingParams/EngineConfig/BenchSettings, loads two model copies, calls specrun.bench.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click

from specrun.cli.generate import chat_option
from specrun.cli.options import (
    engine_config_from,
    engine_options,
    int_list,
    model_options,
    rope_option,
    sampling_options,
    sampling_params_from,
)
from specrun.decoding.choices import PAGED_BACKENDS


@click.command()
@click.option("--prompt", help="Prompt text.")
@click.option("--prompt-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Read the prompt text from this file.")
@click.option("--max-tokens", type=int, default=512, show_default=True,
              help="New tokens per run (with --lengths: the largest length).")
@click.option("--repeat", type=int, default=3, show_default=True, help="Timed runs per configuration, interleaved.")
@click.option("--lengths", help="Comma list of generated lengths to report ratios at, e.g. 2048,8192,16384.")
@click.option("--warmup", type=int, default=16, show_default=True, help="Untimed warm-up tokens per configuration.")
@click.option("--runs", "only", help="Comma list of run names to keep (default: all that can run, but the compiled_* "
              "rows, which compile for minutes: name them). With --concurrency: of specrun_ar, specrun_spec, "
              "compiled_ar, compiled_spec (default: the first two).")
@click.option("--gguf", type=click.Path(exists=True, dir_okay=False), help="GGUF file of the same model for the "
              "llama_cpp row (default: smollm2's own Q4_1 file with --model smollm2; other models: no llama_cpp row).")
@click.option("--lockstep/--one-by-one", default=True, show_default=True,
              help="Run a repeat's specrun configurations a step each in turn, each timed by its own steps, so a slow "
              "spell of a shared host falls on all alike. It holds one KV cache per configuration at once: "
              "--one-by-one (whole runs one after another) where memory is short. With --concurrency: a level's "
              "runs so.")
@click.option("--concurrency", "levels", help="Comma list of sequences in flight, e.g. 1,4,8: aggregate tok/s of "
              "specrun_ar and specrun_spec on one batched worker at each level (N different prompts), instead of the "
              "default table.")
@click.option("--batch-attention", type=click.Choice(["auto", *PAGED_BACKENDS]), default="auto", show_default=True,
              help="With --concurrency: attention over the paged KV pool (auto: dense on CPU in bf16/fp16, else sdpa).")
@chat_option
@model_options
@rope_option
@sampling_options
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every number instead of tables.")
def bench(prompt, prompt_file, max_tokens, repeat, lengths, warmup, only, gguf, lockstep, levels, batch_attention,
          chat, model, dtype, device, trust_remote_code, as_json, **kw):
    """Benchmark specrun against HF generate on one prompt: tok/s, ratios, acceptance, time per phase.

    Runs hf_ar, hf_prompt_lookup, llama_cpp (where llama-cpp-python is installed and a GGUF file of the model is at
    hand: see --gguf), specrun_ar, specrun_spec (the --draft drafters) and the ablations ngram_only,
    recycling_only, heads_partial and fused_spec (these two need --heads), each --repeat times, interleaved (the
    specrun runs of a repeat in lockstep, a step each in turn: see --lockstep). Every run generates the same
    number of tokens (EOS is ignored). All specrun runs must produce the tokens of specrun_ar, or differ only at a
    numerical near tie (reduced precision; the gap is reported): exit status 1 otherwise.

    \b
    Examples:
      specrun bench --model smollm2 --chat --prompt "Write a long story about a lighthouse." --max-tokens 2048
      specrun bench --model ~/.cache/specrun/proxy-v1 --prompt-file p.txt --max-tokens 4096
      specrun bench --model M --prompt "def main(" --temperature 1 --min-p 0.1 --penalty 1.2 --json
      specrun bench --model M --prompt-file p.txt --lengths 2048,8192,16384 --repeat 1
      specrun bench --model smollm2 --chat --prompt "Write a long story." --max-tokens 1024 --concurrency 1,4,8
    """
    from specrun.bench.hf import hf_notes
    from specrun.bench.llama_cpp import NOTE as LLAMA_NOTE
    from specrun.bench.report import add_roofline, annotate_divergences, render, summarize
    from specrun.bench.runner import (
        EAGER_DRAFT_NOTE,
        BenchSettings,
        bench_params,
        drop_unrunnable,
        plan,
        run_bench,
        select_runs,
    )
    from specrun.cli.generate import encode_prompt, load_for_cli, read_prompt

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt or --prompt-file")
    if levels is not None and lengths:
        raise click.UsageError("--lengths measures one prompt's curve; it does not combine with --concurrency")
    if levels is None and batch_attention != "auto":
        raise click.UsageError("--batch-attention is the attention of --concurrency's batched runs; give --concurrency")
    text = prompt if prompt is not None else read_prompt(prompt_file)
    if levels is not None:
        from specrun.cli.bench_concurrency import bench_concurrency

        return bench_concurrency(text, levels, batch_attention, max_tokens, repeat, chat, model, dtype, device,
                                 trust_remote_code, as_json, kw, only, lockstep)
    lens = int_list(lengths, "--lengths")
    n = max(lens) if lens else max_tokens
    params = sampling_params_from(kw, n)
    base = engine_config_from(kw)
    heads_path = kw.get("heads_path")  # --heads (engine option): also enables the heads_partial ablation
    try:
        settings = BenchSettings(max_tokens=n, repeat=repeat, lengths=lens, warmup=warmup,
                                 heads_path=str(heads_path) if heads_path else None, lockstep=lockstep)
    except ValueError as e:
        raise click.BadParameter(str(e)) from e
    try:
        runs = select_runs(only)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--runs") from None
    planned, notes = plan(base, settings.heads_path, runs)
    if params.stop or params.stop_token_ids:
        notes.append("--stop / --stop-token-id ignored: every run generates exactly --max-tokens tokens")
    if not planned:
        raise click.ClickException("nothing to run: " + "; ".join(notes))

    from specrun.models.loader import resolve_dtype

    try:
        dtype = resolve_dtype(dtype, model, device)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"cannot load model {model!r}: {e}") from e
    lm = load_for_cli(model, dtype, device, trust_remote_code, kw.get("rope_scaling"))
    planned = drop_unrunnable(planned, lm, notes)
    prompt_ids = encode_prompt(lm, text, chat)
    if len(prompt_ids) + n > lm.max_context:
        raise click.ClickException(f"prompt ({len(prompt_ids)} tokens) + {n} new tokens exceeds the model context "
                                   f"of {lm.max_context}")
    hf_lm = None
    if any(spec.kind == "hf" for spec, _ in planned):
        from specrun.models.loader import load_model

        hf_lm = load_model(lm.path, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                           rope_scaling=kw.get("rope_scaling"))  # own copy, SDPA
        notes = hf_notes(params, len(prompt_ids)) + notes
    llama = None
    if any(spec.kind == "llama_cpp" for spec, _ in planned):
        llama = _llama_cpp(lm, gguf, len(prompt_ids) + n, params)
        if isinstance(llama, str):
            notes.append(llama)
            planned, llama = [(spec, t) for spec, t in planned if spec.kind != "llama_cpp"], None
        else:
            notes.append(LLAMA_NOTE)
    if not planned:
        raise click.ClickException("nothing to run: " + "; ".join(notes))
    notes.append("specrun runs use a fresh Engine each (cold drafters: no recycling state carried between runs)")

    def log(msg: str) -> None:
        click.echo(msg, err=True)

    from specrun.bench.roofline import read_bandwidth, roofline

    probes: list[float] = []  # the host's bandwidth before the first repeat and after each
    try:
        ms = run_bench(lm, hf_lm, prompt_ids, params, planned, settings, log=log,
                       between=lambda: probes.append(read_bandwidth(lm.device)), llama=llama)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    meta = {"model": lm.path, "fingerprint": lm.fingerprint, "device": str(lm.device), "dtype": dtype,
            "prompt_tokens": len(prompt_ids), "tokens": n, "repeat": repeat, "lockstep": lockstep,
            "mode": "greedy" if params.greedy else "sampled",
            "sampling": {k: getattr(params, k) for k in params.__dataclass_fields__},
            "engine": dataclasses.asdict(base)}
    report = summarize(ms, {spec.name: spec.kind for spec, _ in planned}, lens, params.greedy, notes, meta)
    auto = {spec.name for spec, config in planned if spec.kind == "specrun" and config.compile_draft == "auto"}
    if any(r.get("draft_eager") and r["name"] in auto for r in report["runs"]):  # not eager_draft_spec's own choice
        report["notes"].append(EAGER_DRAFT_NOTE)
    from specrun.bench.neartie import check_divergence

    run_params = bench_params(params, n)  # as run_bench ran them
    ref_run = next((m for m in ms if m.name == report["reference"] and m.repeat == 0), None)
    compiled = bool(ref_run and ref_run.stats.get("compiled_layers"))  # AR's replay takes the layers it ran
    annotate_divergences(report, ms, lambda ref, toks: check_divergence(lm, prompt_ids, run_params, ref, toks,
                                                                               base.prefill_chunk, compiled))
    add_roofline(report, roofline(lm, len(prompt_ids) + n // 2, probes))
    if as_json:
        click.echo(json.dumps(report))
    else:
        from rich.console import Console

        render(report, Console(file=sys.stdout, width=160))
    if not report["lossless"]:  # a divergence from AR that is not a numerical near tie
        sys.exit(1)


def _llama_cpp(lm, gguf: str | None, n_ctx: int, params):
    """The llama_cpp row's model, or the note saying why the row is skipped."""
    import torch

    from specrun.bench.llama_cpp import find_gguf, load_llama_cpp

    path = find_gguf(lm, gguf)
    if path is None:
        return "llama_cpp skipped: no GGUF file of this model (give one with --gguf)"
    if lm.device.type != "cpu":
        return "llama_cpp skipped: the baseline runs on CPU only"
    return load_llama_cpp(path, n_ctx, torch.get_num_threads(), params)
