"""`specrun report`: a thin click command over specrun.report.

It fills ReportConfig and turns what goes wrong into ClickExceptions naming the value at fault.
"""

from __future__ import annotations

from pathlib import Path

import click

from specrun.cli.location import JobLocation


@click.command()
@click.argument("job_dir", type=JobLocation(exists=True))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The HTML page (default: JOB/report.html, or ./<job name>-report.html for a job on an object "
                   "store); PNGs of the job charts go beside it as <name>-<chart>.png.")
@click.option("--prompts", "max_prompts", type=click.IntRange(min=0), default=20, show_default=True,
              help="Prompts (in input order) with their own section and line in the job charts; the job-wide curves "
                   "and totals count every prompt.")
@click.option("--no-png", is_flag=True, help="Write the page only.")
def report(job_dir, output, max_prompts, no_png):
    """One self-contained HTML page of a job (it needs no network), finished, running or interrupted.

    Per prompt and for the whole job: tok/s, accepted tokens per step and the trie width the tuner chose against
    generated position, checkpointed tokens over time, time per phase, tokens per drafter and Distinct-1..4; resumes
    are marked. Read from what the workers record at each checkpoint; the job is not changed. Needs the plotting
    extra: pip install 'specrun[report]'.

    \b
    Examples:
      specrun report specrun-jobs/prompts                  # specrun-jobs/prompts/report.html, report-*.png
      specrun report specrun-jobs/prompts -o report.html --prompts 5
      specrun report specrun-jobs/prompts -o /tmp/r.html --no-png
    """
    from specrun.jobs.jobdir import JobDir, JobError
    from specrun.report import ReportConfig, ReportError, write_report

    try:
        default = job_dir / "report.html" if isinstance(job_dir, Path) else Path(f"{job_dir.name}-report.html")
        config = ReportConfig(output or default, max_prompts, png=not no_png)
        files = write_report(JobDir(job_dir), config)
    except (ReportError, JobError, ValueError) as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"wrote {files[0]}" + (f" and {len(files) - 1} PNG file(s) beside it" if len(files) > 1 else ""),
               err=True)
