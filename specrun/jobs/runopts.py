"""What a run is asked to do (RunOptions) and what it did (RunSummary, whose exit_code the CLI returns)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

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


@dataclass
class RunSummary:
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    stopped: list[str] = field(default_factory=list)
    interrupted: bool = False
    stop_signal: int | None = None  # the signal that stopped the run (SIGINT, SIGTERM, SIGHUP)

    @property
    def exit_code(self) -> int:
        if self.failed:
            return EXIT_FAILED
        if self.interrupted:
            return 128 + (self.stop_signal or signal.SIGINT)
        return EXIT_OK
