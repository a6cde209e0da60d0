"""`submit/resume --detach` (the run goes to a Ray cluster as a Ray Job and the command returns at once) and
`specrun stop JOB` (from any machine that sees the job directory); the policy lives in jobs/detach.py and jobs/stop.py.
"""

from __future__ import annotations

import sys

import click

from specrun.cli.location import JobLocation
from specrun.storage.fs import location

# never carried into the detached command: it runs `resume JOB`, on the cluster it is sent to
NOT_CARRIED = {"job_dir", "detach", "address", "model_path"}


def check_detach(detach: bool, address: str | None) -> None:
    """--detach needs a cluster to send the run to: refused before anything is written."""
    if detach and not address:
        raise click.UsageError("--detach needs a Ray cluster: give --address http://HEAD:8265 (its dashboard) or set "
                               "RAY_ADDRESS")


def given_flags(ctx: click.Context, names: set[str]) -> list[str]:
    """The options among `names` that were given to this command (command line or environment), as arguments for
    running it again elsewhere: paths absolute, object-store locations as URIs."""
    out: list[str] = []
    for p in ctx.command.params:
        source = ctx.get_parameter_source(p.name)
        if not isinstance(p, click.Option) or p.name not in names or source in (
                None, click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP):
            continue
        value = ctx.params[p.name]
        if p.is_flag:
            if value or p.secondary_opts:
                out.append(_long(p.opts) if value else _long(p.secondary_opts))
            continue
        for v in (value if p.multiple else (value,)):
            out += [_long(p.opts), location(v) if isinstance(p.type, click.Path) else str(v)]
    return out


def _long(opts: list[str]) -> str:
    return max(opts, key=len)


def run_detached(ctx: click.Context, job, address: str | None, resume: click.Command,
                 model_path: str | None = None) -> int:
    """Submit `specrun resume JOB` (with this command's flags that `resume`, the command given, takes: run, device,
    drafting and checkpoint flags) as a Ray Job; print its id and how to follow it. Exit status 0 once Ray has accepted
    it."""
    from specrun.jobs.detach import submit_detached
    from specrun.jobs.jobdir import JobError

    carried = {p.name for p in resume.params} - NOT_CARRIED
    args = ["specrun", "resume", location(job.root), *given_flags(ctx, carried)]
    if model_path is not None:
        args += ["--model", model_path]
    try:
        run = submit_detached(job, address, args)
    except JobError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"submitted job {job.root} to Ray at {run.address} as Ray job {run.ray_job_id}", err=True)
    click.echo(f"follow it:  specrun status {job.root} --watch   or   ray job logs -f {run.ray_job_id} "
               f"--address {run.address}", err=True)
    click.echo(f"stop it:    specrun stop {job.root}", err=True)
    click.echo(run.ray_job_id)
    return 0


@click.command()
@click.argument("job_dir", type=JobLocation(exists=True))
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="Seconds to wait for the driver to checkpoint and exit (0: ask it to stop and return).")
def stop(job_dir, wait_s):
    """Stop a running job as Ctrl-C would: running prompts are checkpointed, then the driver exits; `specrun resume`
    continues it. Works from any machine that sees JOB_DIR for a detached job (`submit --detach`: through the Ray
    cluster's Jobs API), and on the driver's own host for one started in a terminal.

    \b
    Examples:
      specrun stop specrun-jobs/prompts
      specrun stop specrun-jobs/prompts --wait 0
    """
    from specrun.jobs.jobdir import JobDir, JobError
    from specrun.jobs.stop import stop_job

    job = JobDir(job_dir)
    try:
        res = stop_job(job, wait_s)
    except JobError as e:
        raise click.ClickException(str(e)) from e
    ray = f" (Ray job {res.ray_status})" if res.ray_status else ""
    if res.how == "none":
        click.echo(f"no driver is running job {job.root}{ray}; nothing to stop", err=True)
    elif res.done:
        click.echo(f"stopped job {job.root}{ray}; checkpointed tokens are kept. Resume with: specrun resume "
                   f"{job.root}  (add --detach --address ADDRESS to run it on a Ray cluster again)", err=True)
    elif wait_s > 0:
        click.echo(f"job {job.root} was asked to stop but its driver is still running after {wait_s:g} s{ray}; "
                   f"see `specrun status {job.root}`", err=True)
        sys.exit(1)
    else:
        click.echo(f"job {job.root} was asked to stop{ray}", err=True)
