"""The specrun exception family: every problem a caller must act on is a SpecrunError whose message is the one the
CLI prints (the CLI turns any of them into its error line and exit status 1); library code never calls sys.exit.
"""

from __future__ import annotations


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
