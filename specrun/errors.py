"""The specrun exception family: every problem a caller must act on is a SpecrunError whose message is the one the
CLI prints (the CLI turns any of them into its error line and exit status 1); library code never calls sys.exit.
"""

from __future__ import annotations

import errno
import numbers


class SpecrunError(Exception):
    """Base of specrun's errors: str(e) says what is wrong and what to do."""


class ModelError(SpecrunError, ValueError):
    """A model that cannot be loaded (missing directory, unsupported architecture, bad dtype or device)."""


class PromptError(SpecrunError, ValueError):
    """A prompt that cannot be generated from (empty, bad token ids, no chat template for messages, too long)."""


class ConfigError(SpecrunError, ValueError):
    """A setting that cannot work (an unknown drafter, a sampling value out of range, a bad column choice)."""


class InputError(SpecrunError, ValueError):
    """A prompts file (JSON lines or Parquet) with bad lines or that cannot be read: lists them, nothing was started."""

    def __init__(self, path: str, problems: list[str], total: int):
        self.problems, self.total = problems, total
        more = f"\n  ... and {total - len(problems)} more" if total > len(problems) else ""
        super().__init__(f"{path}: {total} problem(s), nothing was started:\n  " + "\n  ".join(problems) + more)


def describe_os_error(e: OSError) -> str:
    """One line: what failed, on which file, and what it means for the job."""
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    what = f"{where}: {e.strerror or e}" if where else f"{type(e).__name__}: {e.strerror or e}"
    hint = {errno.ENOSPC: "free some space, then run the command again (a job keeps its checkpointed tokens)",
            errno.EDQUOT: "free some space, then run the command again (a job keeps its checkpointed tokens)",
            errno.EROFS: "the file system is read-only; `specrun status` and `specrun export` still read a job there",
            errno.EACCES: "check the permissions", errno.EPERM: "check the permissions"}.get(e.errno)
    return what + (f" ({hint})" if hint else "")


def is_number(x) -> bool:
    """A real number of any kind (numpy's too), not a bool: what a duration or a share may be."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_whole(x) -> bool:
    """An integer of any kind (numpy's too), not a bool: what a count or a size may be."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
