"""`specrun bench --concurrency 1,4,8`: aggregate tok/s with N prompts in flight on one batched worker (table or JSON).

Exits 1 when a sequence differs from the same prompt's AR tokens other than at a near tie, or at all in
float32/float64 (there it must be exact).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import click

from specrun.cli.options import engine_config_from, int_list, sampling_params_from

RUNS = ("specrun_ar", "specrun_spec", "compiled_ar", "compiled_spec")


def concurrency_configs(base, only: str | None) -> dict:
    """The batched runs --runs names (default: specrun_ar and specrun_spec); the compiled_* ones with compiled
    layers (and each drafter as `--compile` runs it)."""
    every = {"specrun_ar": dataclasses.replace(base, drafters=()), "specrun_spec": base,
             "compiled_ar": dataclasses.replace(base, drafters=(), compile_layers="on"),
             "compiled_spec": dataclasses.replace(base, compile_layers="on")}
    names = [n.strip() for n in only.split(",") if n.strip()] if only else ["specrun_ar", "specrun_spec"]
    bad = [n for n in names if n not in every]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) if bad else repr(only)}: with --concurrency the runs are {', '.join(RUNS)}",
                                 param_hint="--runs")
    return {n: every[n] for n in names}


def bench_concurrency(text, levels, backend, max_tokens, repeat, chat, model, dtype, device, trust_remote_code,
                      as_json, kw, only: str | None = None, lockstep: bool = True) -> None:
    from specrun.bench.concurrency import compile_notes, prompt_variants, run_concurrency, summarize_concurrency
    from specrun.cli.generate import encode_prompt, load_for_cli
    from specrun.decoding.forward.decoder import FusedDecoder
    from specrun.decoding.forward.paged_attention import resolve_backend
    from specrun.models.loader import resolve_dtype

    levels = int_list(levels, "--concurrency")
    if backend == "flashinfer" and not str(device).startswith("cuda"):
        raise click.BadParameter("flashinfer runs on CUDA; on the CPU take auto, sdpa, dense or paged",
                                 param_hint="--batch-attention")
    params = sampling_params_from(kw, max_tokens)
    base = engine_config_from(kw)
    configs = concurrency_configs(base, only)
    try:
        dtype = resolve_dtype(dtype, model, device)
    except (ValueError, OSError) as e:
        raise click.ClickException(f"cannot load model {model!r}: {e}") from e
    lm = load_for_cli(model, dtype, device, trust_remote_code)
    prompts = [encode_prompt(lm, t, chat) for t in prompt_variants(text, max(levels))]
    backend = resolve_backend(backend, lm.dtype, lm.device, FusedDecoder.of(lm.model).head_dim)
    try:
        rows = run_concurrency(lm, prompts, params, levels, configs, repeat, backend,
                               log=lambda m: click.echo(m, err=True), lockstep=lockstep)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    table = summarize_concurrency(rows)
    report = {"model": lm.path, "dtype": dtype, "device": str(lm.device), "tokens_per_prompt": max_tokens,
              "backend": backend, "mode": "greedy" if params.greedy else "sampled", "lockstep": lockstep, "runs": rows,
              "table": table, "notes": compile_notes(rows, configs)}
    if as_json:
        click.echo(json.dumps(report))
    else:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{lm.path} {dtype}, {max_tokens} new tokens per prompt, aggregate over the prompts in flight")
        for col in ("run", "concurrency", "tok/s", "vs concurrency 1", "vs AR", "accepted/step", "same as AR"):
            t.add_column(col)
        for r in table:
            t.add_row(r["name"], str(r["concurrency"]), f"{r['tokens_per_s']:.1f}", f"{r['vs_concurrency_1']:.2f}x",
                      f"{r['vs_ar']:.2f}x" if r["vs_ar"] else "-", f"{r['mean_accepted']:.2f}",
                      "yes" if r["identical_to_ar"] else "near tie" if r["lossless"] else "[red]NO[/red]")
        console = Console(file=sys.stdout, width=160)
        console.print(t)
        for note in report["notes"]:
            console.print(f"note: {note}", highlight=False)
    exact = dtype in ("float32", "float64")
    if not all(r["lossless"] and (r["identical_to_ar"] or not exact) for r in table):
        sys.exit(1)
