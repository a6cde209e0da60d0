"""Ray plumbing: a quiet local `ray.init()` (or joining --address / RAY_ADDRESS) and GenerationWorker actors.

The only module besides the driver that imports ray; one actor per GPU (num_gpus), or --actors N CPU actors.
"""

from __future__ import annotations

import os
from pathlib import Path

from specrun.actors.worker import GenerationWorker, WorkerSpec

REPO_ROOT = str(Path(__file__).resolve().parents[2])


def init_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Connect to Ray; returns True when this call started it (the caller then shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level="ERROR")
    if address:
        ray.init(address=address, **kwargs)
    else:
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        ray.init(num_cpus=num_cpus, runtime_env={"env_vars": {"PYTHONPATH": path}}, **kwargs)
    return True


def start_worker(spec: WorkerSpec, slot: int, gpus_per_actor: float):
    """A GenerationWorker actor; two threads so request_stop can reach it while generate runs."""
    import ray

    opts = {"max_concurrency": 2, "max_restarts": 0, "num_cpus": 1}
    if gpus_per_actor > 0:
        opts["num_gpus"] = gpus_per_actor
    return ray.remote(GenerationWorker).options(**opts).remote(spec, slot)


def infra_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the actor/node went away (retry the prompt elsewhere), not a bug in the prompt."""
    from ray import exceptions as e

    names = ("RayActorError", "WorkerCrashedError", "ObjectLostError", "NodeDiedError", "ActorUnavailableError",
             "OwnerDiedError")
    return tuple(getattr(e, n) for n in names if hasattr(e, n))
