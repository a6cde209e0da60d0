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
