"""The `specrun` command line: a thin click layer that fills config dataclasses and calls the packages.

Subcommands live one module per concern: generate (one prompt), jobs (submit/resume/status/export).
"""

from __future__ import annotations

import click

from specrun import __version__
from specrun.errors import SpecrunError, describe_os_error


class _Main(click.Group):
    """The rule of every command: no traceback for a user's input, file or environment. A SpecrunError is its message
    (the library raises, only the CLI exits); an OSError (a read-only or full disk, a permission) is one line naming
    the file; any other unexpected error is one line saying where its full traceback was written."""

    def invoke(self, ctx):
        from specrun.jobs.interrupts import stop_on_signals

        try:
            with stop_on_signals() as stopped:  # from the first instant, not only once the driver is up
                return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo(f"stopped by {stopped.name}", err=True)
            ctx.exit(128 + stopped.signum)
        except (click.ClickException, click.exceptions.Exit, click.Abort, SystemExit):
            raise
        except SpecrunError as e:  # the library raises, only the CLI exits
            raise click.ClickException(str(e)) from e
        except BrokenPipeError as e:  # the reader of our stdout left (`| head`): quiet, as coreutils are
            if not _stdout_gone():
                raise click.ClickException(describe_os_error(e)) from e
            ctx.exit(128 + 13)  # SIGPIPE's status
        except OSError as e:
            raise click.ClickException(describe_os_error(e)) from e
        except Exception as e:  # the one place that turns a bug into a report
            raise click.ClickException(f"internal error: {type(e).__name__}: {str(e)[:300]} "
                                       f"({write_traceback(e)})") from e


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader left (poll says so: another pipe's error is not hidden); stdout is then
    pointed at /dev/null, so that the exit's flush stays quiet."""
    import os
    import select
    import stat
    import sys

    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
            return False
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
        return True
    except (OSError, ValueError):
        return False


def write_traceback(e: BaseException) -> str:
    """Writes the traceback to a file in the temporary directory; -> where (or why it could not be written)."""
    import tempfile
    import time
    import traceback

    try:
        fd, path = tempfile.mkstemp(prefix=f"specrun-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with open(fd, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(e)))
        return f"full traceback in {path}; please report it"
    except OSError as err:
        return f"its traceback could not be written: {err}"


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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
