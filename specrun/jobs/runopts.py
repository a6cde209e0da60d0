"""What a run is asked to do (RunOptions) and what it did (RunSummary, whose exit_code the CLI returns)."""

from __future__ import annotations

import math
import os
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specrun.errors import ConfigError, is_number, is_whole

if TYPE_CHECKING:  # the engine's modules (torch) load where a run needs them, not for `specrun status`
    from specrun.decoding.engine import EngineConfig

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 128 + signal.SIGINT  # a stop by signal S exits 128 + S


@dataclass(frozen=True)
class RunOptions:
    actors: int | None = None  # None: 1 on CPU, one per GPU in the cluster on CUDA
    address: str | None = None
    gpus_per_actor: float = 1.0  # used when the job's device is cuda
    max_attempts: int = 3
    hot_start: tuple[str, ...] = ()
    quiet: bool = False
    model_path: str | None = None  # where the model lives now (default: the manifest's path)
    poll_s: float = 0.25
    connect_timeout_s: float = 30.0  # --address: the Ray head must answer within this
    place_timeout_s: float = 60.0  # a worker actor must be placed (resources granted, process up) within this
    load_timeout_s: float = 1800.0  # ... and have loaded its model within this once placed
    stop_timeout_s: float = 60.0  # on Ctrl-C/SIGTERM/SIGHUP: longest wait for running prompts to checkpoint
    # settings that may differ between attempts without changing a token (None: as the job was submitted); each
    # attempt records what it used (jobs/attempts.py)
    device: str | None = None
    engine: EngineConfig | None = None  # its attention backend must be the job's (jobdir.OUTPUT_KEYS)
    checkpoint_every: int | None = None
    checkpoint_seconds: float | None = None
    concurrency: int | str = "auto"  # sequences per worker at once (one engine step for all); auto: from memory

    def __post_init__(self):
        try:
            self._check()
        except (TypeError, ValueError) as e:  # a caller's bad value: a ConfigError (a ValueError) naming it
            raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from None

    def _check(self):
        from specrun.storage.jobfs import ObjectPath

        check_device(self.device)
        check_checkpoint(self.checkpoint_every, self.checkpoint_seconds)
        if self.concurrency != "auto" and not (is_whole(self.concurrency) and self.concurrency >= 1):
            raise ValueError(f"concurrency={self.concurrency!r} must be an integer >= 1 or 'auto'")
        if self.actors is not None and not (is_whole(self.actors) and self.actors >= 1):
            raise ValueError(f"actors={self.actors!r} must be an integer >= 1 (or None: one per device)")
        if not (is_whole(self.max_attempts) and self.max_attempts >= 1):
            raise ValueError(f"max_attempts={self.max_attempts!r} must be an integer >= 1")
        for name in ("gpus_per_actor", "poll_s", "connect_timeout_s"):
            check_positive(name, getattr(self, name))
        for name in ("place_timeout_s", "load_timeout_s", "stop_timeout_s"):  # inf: never; 0: at once
            value = getattr(self, name)
            if not is_number(value) or not value >= 0:
                raise ValueError(f"{name}={value!r} must be a number >= 0 (inf: no limit)")
        for name in ("address", "model_path"):  # stored as strings: attempts/ records them as JSON
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, os.PathLike)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a string (or None)")
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        if not isinstance(self.quiet, bool):
            raise ValueError(f"quiet={self.quiet!r} must be True or False")
        if isinstance(self.hot_start, (str, os.PathLike, ObjectPath)) or not all(
                isinstance(h, (str, os.PathLike, ObjectPath)) for h in self.hot_start):
            raise ValueError(f"hot_start={self.hot_start!r} must be a list of job directories")
        if self.engine is not None:
            from specrun.decoding.config import EngineConfig

            if not isinstance(self.engine, EngineConfig):
                raise ValueError(f"engine={self.engine!r} must be an EngineConfig (or None: the job's)")


def check_positive(name: str, value) -> None:
    """A finite number > 0 (not a bool or a string)."""
    if not is_number(value) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def check_device(device) -> None:
    """None (the job's), cpu, cuda or cuda:N: the name only (whether it is there is the worker's to say)."""
    if device is not None and not (isinstance(device, str) and (device == "cpu" or device.startswith("cuda"))):
        raise ValueError(f"device={device!r} must be cpu or cuda")


def check_checkpoint(every: int | None, seconds: float | None) -> None:
    """Checkpoint cadence: every >= 1 new tokens, seconds a finite number > 0 (None: not given)."""
    if every is not None and not (is_whole(every) and every >= 1):
        raise ValueError(f"checkpoint_every={every!r} must be an integer >= 1")
    if seconds is not None:
        check_positive("checkpoint_seconds", seconds)


@dataclass
class RunSummary:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)
    disk_full: str | None = None  # the first write refused for lack of space: the run stopped there

    def closing(self, root, queued: int, stop_timed_out: bool) -> list[tuple[bool, str]]:
        """What the run says as it ends, as (is a warning, line); `queued`: prompts never started."""
        left = len(self.stopped) + queued
        out = [(False, f"{len(self.done)} prompt(s) finished, {len(self.failed)} failed"
                + (f", {left} left" if self.interrupted else ""))]
        if self.disk_full:
            out.append((True, (f"stopped: the disk holding the job is full ({self.disk_full}); {left} prompt(s) "
                               f"left, their checkpointed tokens kept. Free some space, then: specrun resume {root}")))
        elif self.interrupted:
            kept = "checkpointed tokens are kept" if stop_timed_out else "every generated token is checkpointed"
            out.append((True, f"stopped; {kept}. Resume with: specrun resume {root}"))
        if not self.interrupted and not self.failed:
            out.append((False, f"outputs: {root}/outputs; read them with: specrun export {root} --format jsonl"))
        if self.failed:
            out.append((True, (f"{len(self.failed)} prompt(s) failed; see `specrun status {root}`; "
                               f"`specrun resume {root}` retries them")))
        return out

    @property
    def exit_code(self) -> int:
        if self.failed or self.disk_full:
            return EXIT_FAILED
        if self.interrupted:
            return 128 + (self.stop_signal or signal.SIGINT)
        return EXIT_OK
