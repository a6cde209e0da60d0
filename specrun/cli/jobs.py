"""`specrun submit | resume | status | export`: thin click commands over specrun.jobs.

Errors are ClickExceptions naming the bad line or value; exit code is non-zero if any prompt failed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click

from specrun.cli.detach import check_detach, run_detached
from specrun.cli.location import JobLocation
from specrun.cli.options import (
    ENGINE_FLAGS,
    Concurrency,
    engine_config_from,
    engine_options,
    model_options,
    rope_option,
    sampling_options,
    sampling_params_from,
)
from specrun.errors import ConfigError
from specrun.storage.fs import location


def _finite(ctx, param, value):
    """click callback: a float flag must be a finite number (float('nan') and 'inf' parse, and pass range checks)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


run_options = [
    click.option("--actors", type=click.IntRange(min=1), default=None,
                 help="Worker actors. Default: 1 on CPU, one per GPU of the Ray cluster with --device cuda."),
    click.option("--gpus-per-actor", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True,
                 callback=_finite, help="GPUs per actor with --device cuda (fractional packs small models)."),
    click.option("--address", envvar="RAY_ADDRESS", default=None,
                 help="Ray cluster to join (default: $RAY_ADDRESS, else a local Ray started quietly)."),
    click.option("--hot-start", "hot_start", multiple=True, type=JobLocation(exists=True),
                 help="Earlier job dir on the same model whose recycling matrix warms cold workers."),
    click.option("--concurrency", type=Concurrency(), default="auto", show_default=True,
                 help="Prompts each worker generates at once, one batched verify forward per step (--attention "
                      "split runs one). auto: as many as the worker's KV memory holds with the job's longest "
                      "prompt, at most 16. The outputs are the same whatever N."),
    click.option("--quiet", "-q", is_flag=True, help="No progress output (warnings and errors only)."),
    click.option("--detach", is_flag=True, help="Run the driver on the Ray cluster at --address (its dashboard, "
                 "http://HEAD:8265) as a Ray Job and return at once; the job dir must be at the same path there."),
]


checkpoint_options = [
    click.option("--checkpoint-every", type=click.IntRange(min=1), default=2048, show_default=True,
                 help="Checkpoint each running prompt every N new tokens."),
    click.option("--checkpoint-seconds", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
                 callback=_finite, help="... and at least every S seconds."),
]


def _apply(options):
    def deco(f):
        for o in reversed(options):
            f = o(f)
        return f
    return deco


def _check_hot_start(hot_start) -> None:
    """--hot-start names jobs (their recycling matrices warm the workers): a folder without a job.json would warm
    nothing and say nothing."""
    from specrun.job import check_hot_start

    try:
        check_hot_start(hot_start)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--hot-start") from None


def _run(job, actors, gpus_per_actor, address, hot_start, quiet, model_path=None, **attempt) -> int:
    """attempt: this run's device, engine, checkpoint_every, checkpoint_seconds (RunOptions; None = the job's)."""
    from specrun.jobs.driver import RunOptions

    opts = RunOptions(actors=actors, address=address, gpus_per_actor=gpus_per_actor,
                      hot_start=tuple(map(location, hot_start)), quiet=quiet, model_path=model_path, **attempt)
    try:
        return job.run(opts).exit_code
    except KeyboardInterrupt:
        click.echo(f"stopped; checkpointed tokens are kept. Resume with: specrun resume {job.root}", err=True)
        raise


@click.command()
@click.argument("prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--max-tokens", type=click.IntRange(min=1), required=True, help="Most new tokens per prompt.")
@click.option("--prompt-column", default=None, help="Parquet input: the column of prompt texts (default: 'prompt').")
@click.option("--messages-column", default=None,
              help="Parquet input: the column of chat messages (lists of {role, content}) instead.")
@click.option("--id-column", default=None, help="Parquet input: the column of prompt ids (default: 'id' if present, "
              "else the row number).")
@click.option("--job-dir", type=JobLocation(), default=None,
              help="Job directory (default: ./specrun-jobs/<prompts file name>), or an object-store URI such as "
                   "s3://bucket/prefix.")
@_apply(checkpoint_options)
@model_options
@rope_option
@sampling_options
@engine_options
@_apply(run_options)
def submit(prompts, max_tokens, job_dir, checkpoint_every, checkpoint_seconds, model, dtype, device,
           trust_remote_code, actors, gpus_per_actor, address, hot_start, quiet, **kw):
    """Run every prompt of PROMPTS (JSON lines, or Parquet: a .parquet file) as a resumable job on Ray workers.

    Each line has one of "prompt", "messages" or "input_ids", an optional "id" and optional overrides
    (max_tokens, seed, temperature, top_k, top_p, min_p, penalty, penalty_window, stop, stop_token_ids); OpenAI batch lines
    (custom_id, method POST, url, body) work too, and a body field we do not implement is refused by name.
    PROMPTS is read once, so a pipe works with --job-dir (<(zcat p.jsonl.gz)). A Parquet file (an HF dataset's) is
    read by row groups, each row a line of its --prompt-column (or --messages-column) and --id-column. The whole file
    is checked first; nothing starts if any line is bad. Submitting again with the same input, model, dtype, sampling flags and attention
    backend resumes the job; device, drafting, checkpoint and Ray flags may change (each run is recorded).

    \b
    Examples:
      specrun submit prompts.jsonl --max-tokens 100000 --model /models/Llama-3.1-8B --device cuda
      specrun submit prompts.jsonl --max-tokens 2000 --actors 2 --temperature 0.8 --seed 1
      specrun submit train.parquet --prompt-column text --max-tokens 2000
      specrun status specrun-jobs/prompts
    """
    from specrun.job import prepare
    from specrun.jobs.parquet_in import Columns
    from specrun.llm import DEMO_NOTICE

    check_detach(kw["detach"], address)
    _check_hot_start(hot_start)
    params = sampling_params_from(kw, max_tokens)
    engine = engine_config_from(kw)
    names = (kw["prompt_column"], kw["messages_column"], kw["id_column"])
    columns = Columns(*names) if any(n is not None for n in names) else None
    job = prepare(prompts, job_dir, model=model, sampling=params, drafting=engine, dtype=dtype, device=device,
                  trust_remote_code=trust_remote_code, checkpoint_every=checkpoint_every,
                  checkpoint_seconds=checkpoint_seconds, columns=columns, rope_scaling=kw["rope_scaling"],
                  notice=lambda m: click.echo(DEMO_NOTICE, err=True))
    if not quiet:
        click.echo(f"{'created' if job.created else 'resuming'} job {job.root}", err=True)
    if kw["detach"]:
        sys.exit(run_detached(click.get_current_context(), job.dir, address, resume))
    sys.exit(_run(job, actors, gpus_per_actor, address, hot_start, quiet, job.model_path, device=device, engine=engine,
                  checkpoint_every=checkpoint_every, checkpoint_seconds=checkpoint_seconds,
                  concurrency=kw["concurrency"]))


@click.command()
@click.argument("job_dir", type=JobLocation(exists=True))
@click.option("--model", "model_path", default=None,
              help="The job's model at a new location (its fingerprint must match the job's).")
@click.option("--trust-remote-code", is_flag=True,
              help="Needed again to resume a job submitted with --trust-remote-code (job.json alone never allows it).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Default: the job's.")
@_apply(checkpoint_options)
@engine_options
@_apply(run_options)
@click.pass_context
def resume(ctx, job_dir, model_path, trust_remote_code, device, checkpoint_every, checkpoint_seconds, actors,
           gpus_per_actor, address, hot_start, quiet, **kw):
    """Continue an interrupted job from its checkpoints (failed prompts are retried).

    Device, drafting and checkpoint flags that are given replace the job's for this run (the outputs stay the same;
    `specrun status --json` lists what each run used); those not given, and the attention backend, stay the job's.
    Ray flags (--actors, --concurrency, --address, ...) are this run's, with their own defaults. A job submitted with
    --trust-remote-code resumes only with --trust-remote-code given again.

    \b
    Examples:
      specrun resume specrun-jobs/prompts
      specrun resume specrun-jobs/prompts --actors 4 --address ray://head:10001
      specrun resume specrun-jobs/prompts --device cuda --draft none --checkpoint-every 512
    """
    from specrun.actors.worker import engine_config
    from specrun.job import reopen

    check_detach(kw["detach"], address)
    _check_hot_start(hot_start)
    job, model_path = reopen(job_dir, model_path, trust_remote_code)
    if kw["detach"]:
        sys.exit(run_detached(ctx, job.dir, address, resume, model_path))
    given = {n for n in ctx.params if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT}
    try:
        engine = engine_config_from(kw, engine_config(job.dir.manifest()["engine"]), given) \
            if given & set(ENGINE_FLAGS) else None
    except (TypeError, ValueError) as e:  # a job.json whose engine settings this version cannot read
        raise click.ClickException(f"{job.dir.manifest_path}: engine settings unreadable ({e})") from e
    sys.exit(_run(job, actors, gpus_per_actor, address, hot_start, quiet, model_path, device=device, engine=engine,
                  checkpoint_every=checkpoint_every if "checkpoint_every" in given else None,
                  checkpoint_seconds=checkpoint_seconds if "checkpoint_seconds" in given else None,
                  concurrency=kw["concurrency"]))


for _p in resume.params:  # submit's defaults are not a resume's: a flag left out keeps the job's value
    if _p.name in {*ENGINE_FLAGS, "checkpoint_every", "checkpoint_seconds"}:
        _p.show_default = False
        _p.help = f"{_p.help or ''} Default: the job's.".strip()


@click.command()
@click.argument("job_dir", type=JobLocation(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON.")
@click.option("--watch", is_flag=True, help="Show the table again every --interval seconds until no prompt is left to "
              "run (Ctrl-C leaves); exit status 1 if any prompt failed.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, callback=_finite,
              help="Seconds between refreshes with --watch.")
def status(job_dir, as_json, watch, interval):
    """Per-prompt state (pending, running, done, failed), tokens, tok/s, acceptance and ETA, with totals.

    \b
    Examples:
      specrun status specrun-jobs/prompts
      specrun status specrun-jobs/prompts --watch --interval 5
      specrun status specrun-jobs/prompts --json | jq .totals
    """
    from specrun.jobs.jobdir import JobDir, JobError
    from specrun.jobs.status import job_status, render_status

    if watch:
        if as_json:
            raise click.ClickException("--watch redraws the table; it does not combine with --json")
        sys.exit(_watch(JobDir(job_dir), interval))
    try:
        st = job_status(JobDir(job_dir))
    except JobError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps(st, indent=2))
    else:
        from rich.console import Console

        render_status(st, Console())


def _watch(job, interval: float) -> int:
    from rich.console import Console

    from specrun.jobs.jobdir import JobError
    from specrun.jobs.runopts import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
    from specrun.jobs.watch import watch

    try:
        st = watch(job, Console(), interval)
    except JobError as e:
        raise click.ClickException(str(e)) from e
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    return EXIT_FAILED if st["totals"]["failed"] else EXIT_OK


@click.command()
@click.argument("job_dir", type=JobLocation(exists=True))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "openai", "parquet", "text"]), default="jsonl",
              show_default=True, help="jsonl: one JSON object per prompt; openai: OpenAI batch output lines (custom_id, "
              "response with choices and usage); parquet: one file (-o); text: the texts, for reading.")
@click.option("-o", "--output", default=None, help="Output file (default, but for parquet: stdout).")
def export(job_dir, fmt, output):
    """Write the finished rows (id, text, token_ids, finish_reason, stats...) in input order.

    \b
    Examples:
      specrun export specrun-jobs/prompts > out.jsonl
      specrun export specrun-jobs/prompts --format parquet -o out.parquet
      specrun export specrun-jobs/prompts --format openai -o batch_output.jsonl
      specrun export specrun-jobs/prompts --format text | less
    """
    from specrun.jobs.export import export as do_export
    from specrun.jobs.jobdir import JobDir, JobError

    try:
        n, missing = do_export(JobDir(job_dir), fmt, output)
    except (JobError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    if missing:
        click.echo(f"note: {missing} prompt(s) are not done yet and were not exported", err=True)
    if output not in (None, "-"):
        click.echo(f"wrote {n} row(s) to {output}", err=True)
