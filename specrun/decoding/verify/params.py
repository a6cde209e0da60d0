"""SamplingParams: what a generation samples with (AR's settings), validated where it is built. No torch here: the job
directory and the command line read and check them before a model loads.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

from specrun.decoding.verify.stops import check_stop_token_ids, check_stops
from specrun.errors import ConfigError

MAX_INT = 2**31 - 1  # counts and windows beyond any context; larger values overflow int32/int64 tensor arguments
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    eta: float = 0.0
    penalty: float = 1.0
    penalty_window: int = 1024
    seed: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()  # stop strings (a str or list is normalised): the text ends before the first one
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the generation like EOS (finish_reason "stop")

    def __post_init__(self):
        # frozen, and rebuilt from JSON (lists) by the job directory and the worker's task: normalise to tuples
        try:
            object.__setattr__(self, "stop", check_stops(self.stop))
            object.__setattr__(self, "stop_token_ids", check_stop_token_ids(self.stop_token_ids))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for f in fields(self):  # a value of the wrong type fails here, not deep in a generation
            v, kind = getattr(self, f.name), f.type if isinstance(f.type, str) else f.type.__name__
            if kind == "bool" and not isinstance(v, (bool, np.bool_)):
                raise ConfigError(f"{f.name}={v!r} must be True or False")
            if kind == "int" and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise ConfigError(f"{f.name}={v!r} must be an integer")
            if kind == "float" and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
                raise ConfigError(f"{f.name}={v!r} must be a finite number")
            if kind in ("int", "float", "bool") and type(v) not in (int, float, bool):  # numpy's: JSON takes Python's
                object.__setattr__(self, f.name, {"int": int, "float": float, "bool": bool}[kind](v))
        checks = [
            ("max_tokens", 1 <= self.max_tokens <= MAX_INT, f"must be in [1, {MAX_INT}]"),
            ("temperature", self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE,
             f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller ones overflow the scaled logits)"),
            ("top_k", 0 <= self.top_k <= MAX_INT, f"must be in [0, {MAX_INT}] (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p < 1.0, "must be in [0, 1)"),
            ("eta", 0.0 <= self.eta < 1.0, "must be in [0, 1)"),
            ("penalty", self.penalty > 0.0, "must be > 0 (1 = off)"),
            ("penalty_window", 0 <= self.penalty_window <= MAX_INT, f"must be in [0, {MAX_INT}]"),
            ("seed", 0 <= self.seed < 2**63, "must be in [0, 2**63)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalty(self) -> bool:
        return self.penalty != 1.0 and self.penalty_window > 0
