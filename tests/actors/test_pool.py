"""Ray plumbing without a cluster: joining an --address where nothing answers fails fast, naming the address."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from specrun.actors.pool import _ours_after_ray, _probe
from specrun.jobs.interrupts import stop_on_signals


def test_unreachable_ray_address_fails_fast_with_the_address():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}' within 5 s"):
        _probe(f"127.0.0.1:{port}", 5)
    assert time.monotonic() - t0 < 5
    _probe("auto", 5)  # no host:port: left to Ray


def test_a_cluster_left_by_ray_start_is_named_not_a_traceback(monkeypatch):
    """ray.init() without an address joins a cluster that `ray start` advertised on this machine and then refuses
    num_cpus with a ValueError: init_ray turns that into a ConnectionError saying what to do."""
    ray = pytest.importorskip("ray")
    from specrun.actors.pool import init_ray

    def init(**kwargs):
        raise ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConnectionError, match="--address auto"):
        init_ray(None, num_cpus=2)


def test_a_sigterm_while_ray_starts_takes_the_drivers_clean_stop(monkeypatch):
    """ray.init puts in a SIGTERM handler that exits (sys.exit(15), no message, no run recorded): the driver's own
    handler is back once it returns, and a SIGTERM Ray's caught is sent again to it, Ray shut down (stop_on_signals:
    "stopped by SIGTERM", exit status 143)."""
    import ray

    shutdowns = []
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))  # no Ray here to stop, nor any other test's
    with pytest.raises(KeyboardInterrupt), stop_on_signals() as stopped:
        ours = signal.getsignal(signal.SIGTERM)
        with _ours_after_ray():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does
            os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.signum == signal.SIGTERM and shutdowns == [1]
    with stop_on_signals():
        ours = signal.getsignal(signal.SIGTERM)
        with _ours_after_ray():
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
        assert signal.getsignal(signal.SIGTERM) is ours  # a SIGTERM after ray.init reaches the driver's handler


def test_a_local_ray_starts_with_the_workers_environment_so_its_actors_take_idle_workers(monkeypatch):
    """init_ray starts a local Ray with PYTHONPATH and worker_env() in its processes' environment (the driver's own
    comes back after), so an actor there needs no runtime_env (Ray would start it a worker of its own, ~1 s); another
    Ray, or another MALLOC_ARENA_MAX since, gets the runtime_env."""
    ray = pytest.importorskip("ray")
    import specrun.actors.pool as pool
    import specrun.actors.reaper as reaper

    started, gcs = [], ["10.0.0.1:6379"]

    def init(**kwargs):
        started.append((kwargs, os.environ.get("PYTHONPATH"), os.environ.get("MALLOC_ARENA_MAX")))

    monkeypatch.setattr(pool, "_LOCAL", {})
    monkeypatch.setattr(ray, "is_initialized", lambda: bool(started))
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Context", (), {"gcs_address": gcs[0]}))
    monkeypatch.setattr(reaper, "start_reaper", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert pool.actor_runtime_env() == {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "2"}}}  # no Ray of ours yet
    assert pool.init_ray(None, num_cpus=2)
    [(kwargs, path, arenas)] = started
    assert "runtime_env" not in kwargs and path == f"{pool.REPO_ROOT}{os.pathsep}/elsewhere" and arenas == "2"
    assert os.environ["PYTHONPATH"] == "/elsewhere" and "MALLOC_ARENA_MAX" not in os.environ
    assert pool.actor_runtime_env() == {}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "5")
    assert pool.actor_runtime_env() == {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "5"}}}
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    gcs[0] = "10.0.0.1:6380"  # a Ray someone else started since
    assert pool.actor_runtime_env() == {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "2"}}}
