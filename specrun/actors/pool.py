"""Ray plumbing: a quiet local `ray.init()` (or joining --address / RAY_ADDRESS), GenerationWorker actors, and the
cluster-resource checks that let the driver refuse at once, naming the missing resource, instead of waiting forever.

The only module besides the driver that imports ray; one actor per GPU (num_gpus), or --actors N CPU actors.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from pathlib import Path

from specrun.actors.worker import GenerationWorker, WorkerSpec

REPO_ROOT = str(Path(__file__).resolve().parents[2])
CPUS_PER_ACTOR = 1
# glibc's malloc gives threads arenas of their own (up to 8 a core): in a worker, Ray's threads and torch's each kept
# freed temporaries of long-context steps in theirs (docs/benchmarks.md, "Stop 55"); the driver's own value wins
MALLOC_ARENAS = "2"
_LOCAL: dict = {}  # the local Ray init_ray started: its GCS address and the worker_env() its processes inherited


def _probe(address: str, timeout_s: float) -> None:
    """ray.init waits minutes (retrying) for a head that is not there: fail fast when nothing answers at host:port."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local", or no port: let Ray resolve it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r} within {timeout_s:g} s "
                              f"({type(e).__name__}: {e}); check --address / RAY_ADDRESS and that the head "
                              f"is up") from None


def init_ray(address: str | None, num_cpus: int | None = None, connect_timeout_s: float = 30.0) -> bool:
    """Connect to Ray; returns True when this call started it (the caller then shuts it down). Raises ConnectionError
    when nothing answers at --address within connect_timeout_s.

    A local Ray's processes are started with SIGHUP ignored: closing the terminal hangs up its whole process group,
    and the workers must live on to checkpoint while the driver stops (as Ray already does for Ctrl-C's SIGINT).
    """
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    kwargs = dict(include_dashboard=False, log_to_driver=False, configure_logging=True, logging_level="ERROR")
    with _ours_after_ray():
        if address:
            _probe(address, connect_timeout_s)
            ray.init(address=address, **kwargs)
            return True
        path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        env = worker_env()
        main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP")
        old = signal.signal(signal.SIGHUP, signal.SIG_IGN) if main else None
        try:
            try:
                with _environ({"PYTHONPATH": path, **env}):
                    ray.init(num_cpus=num_cpus, **kwargs)
                _LOCAL.update(gcs=_gcs_address(), env=env)
            except ValueError as e:  # `ray start` left a cluster on this machine: ray.init joins it, refusing num_cpus
                if "existing cluster" not in str(e):
                    raise
                raise ConnectionError("a Ray cluster started with `ray start` runs on this machine, and a local run "
                                      "would join it: give --address auto to run on it, or stop it (`ray stop`)"
                                      ) from None
        finally:
            if main:
                signal.signal(signal.SIGHUP, old)
    from specrun.actors.reaper import start_reaper

    start_reaper()  # a SIGKILLed driver leaves no Ray process behind
    return True


class _ours_after_ray:
    """ray.init puts in its own SIGTERM handler (sys.exit(15)): the caller's comes back once it returns, and a SIGTERM
    that Ray's caught while it started is shut down (what Ray started so far) and sent again to the caller's handler,
    so that it takes the driver's clean stop (the run recorded, exit status 143) instead of a bare exit."""

    def __enter__(self):
        self.main = threading.current_thread() is threading.main_thread()
        self.old = signal.getsignal(signal.SIGTERM) if self.main else None
        return self

    def __exit__(self, kind, e, tb):
        if not self.main or self.old is None:  # None: a handler put in from C, which Python cannot put back
            return False
        signal.signal(signal.SIGTERM, self.old)
        if kind is SystemExit and e.code == signal.SIGTERM and callable(self.old):
            import ray

            ray.shutdown()
            signal.raise_signal(signal.SIGTERM)  # the caller's handler runs now (stop_on_signals raises)
            raise KeyboardInterrupt  # a handler that only took note: Ray is stopped, the run cannot go on
        return False


def start_worker(spec: WorkerSpec, slot: int, gpus_per_actor: float):
    """A GenerationWorker actor that loads nothing yet: ping() answers once it is placed, load() loads the model.
    One thread per sequence it generates at once, plus one, so that ping and request_stop reach it while load or
    generate runs."""
    import ray

    opts = {"max_concurrency": spec.concurrency + 1, "max_restarts": 0, "num_cpus": CPUS_PER_ACTOR,
            **actor_runtime_env()}
    if gpus_per_actor > 0:
        opts["num_gpus"] = gpus_per_actor
    return ray.remote(GenerationWorker).options(**opts).remote(spec, slot, False)


def worker_env() -> dict[str, str]:
    """Environment variables a worker process starts with (merged by Ray with the job's)."""
    return {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", MALLOC_ARENAS)}


def actor_runtime_env() -> dict:
    """Actor options giving a worker worker_env(): none on the local Ray init_ray started with it (its processes
    inherited it), whose idle workers then take the actor at once; else a runtime_env, whose own workers Ray starts
    through its agent (about a second more an actor)."""
    env = worker_env()
    if _LOCAL.get("env") == env and _LOCAL.get("gcs") == _gcs_address():
        return {}
    return {"runtime_env": {"env_vars": env}}


def _gcs_address() -> str | None:
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """os.environ with `values` while the block runs (the processes ray.init starts inherit them); then those keys as
    before, and only those (not mock.patch.dict: ray.init sets others in the driver, e.g. PYTHONBREAKPOINT)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _num(x: float) -> str:
    return f"{x:g}"


def resource_shortfall(n: int, gpus_per_actor: float, actors_flag: int | None = None) -> str | None:
    """Why `n` actors (each CPUS_PER_ACTOR CPU, plus gpus_per_actor GPUs when > 0) can never all be placed on this
    Ray cluster as it is now, or None. Counts the cluster's total resources (held ones free up later)."""
    import ray

    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    who = f"--actors {n}" if actors_flag == n else f"{n} worker actor(s)"
    if gpus_per_actor > 0:
        if gpus <= 0:
            return (f"no GPU in the Ray cluster: --device cuda needs {_num(gpus_per_actor)} GPU per actor "
                    f"(--gpus-per-actor), the cluster has 0; use --device cpu, or --address a cluster with GPUs")
        if n * gpus_per_actor > gpus + 1e-9:
            return (f"{who} with --gpus-per-actor {_num(gpus_per_actor)} need(s) {_num(n * gpus_per_actor)} GPUs, "
                    f"the Ray cluster has {_num(gpus)}")
        per_node = [nd.get("Resources", {}).get("GPU", 0.0) for nd in ray.nodes() if nd.get("Alive")]
        if per_node and gpus_per_actor > max(per_node) + 1e-9:
            return (f"--gpus-per-actor {_num(gpus_per_actor)}: no node of the Ray cluster has that many GPUs "
                    f"(the largest has {_num(max(per_node))})")
    if n * CPUS_PER_ACTOR > cpus + 1e-9:
        return f"{who} need(s) {n * CPUS_PER_ACTOR} CPUs ({CPUS_PER_ACTOR} per actor), the Ray cluster has {_num(cpus)}"
    return None


def describe_resources(gpus_per_actor: float) -> str:
    """'needs 1 CPU and 1 GPU; the Ray cluster has 2 CPU (0 free), 1 GPU (0 free)' for placement-timeout messages."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    need = f"{CPUS_PER_ACTOR} CPU" + (f" and {_num(gpus_per_actor)} GPU" if gpus_per_actor > 0 else "")
    have = ", ".join(f"{_num(total.get(r, 0.0))} {r} ({_num(free.get(r, 0.0))} free)" for r in ("CPU", "GPU"))
    return f"each needs {need}; the Ray cluster has {have}"


def infra_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the actor/node went away (retry the prompt elsewhere), not a bug in the prompt."""
    from ray import exceptions as e

    names = ("RayActorError", "WorkerCrashedError", "ObjectLostError", "NodeDiedError", "ActorUnavailableError",
             "OwnerDiedError")
    return tuple(getattr(e, n) for n in names if hasattr(e, n))
