"""The `specrun` command line: a thin click layer that fills config dataclasses and calls the packages.

Subcommands live one module per concern: generate (one prompt), jobs (submit/resume/status/export).
"""

from __future__ import annotations

import click

from specrun import __version__
from specrun.errors import SpecrunError


class _Group(click.Group):
    """Every SpecrunError a command lets through is printed as its message with exit status 1 (click's error line):
    the library raises, only the CLI exits."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SpecrunError as e:
            raise click.ClickException(str(e)) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="specrun")
def main() -> None:
    """Lossless speculative decoding for ultra-long generations, run as resumable jobs.

    \b
    Examples:
      specrun generate --prompt "Once upon a time" --max-tokens 200
      specrun submit prompts.jsonl --max-tokens 100000 --model /models/Llama-3.1-8B
      specrun status specrun-jobs/prompts
    """


def _register() -> None:
    from specrun.cli.bench import bench
    from specrun.cli.detach import stop
    from specrun.cli.generate import generate
    from specrun.cli.jobs import export, resume, status, submit
    from specrun.cli.report import report
    from specrun.cli.train import train_heads
    from specrun.cli.train_drafter import train_drafter

    for cmd in (generate, submit, resume, status, stop, export, report, train_heads, train_drafter, bench):
        main.add_command(cmd)


_register()
