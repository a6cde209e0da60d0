"""Shared fixtures: tiny offline models (built once per session into a tmp dir) and a private SPECRUN_CACHE.

Fixtures: tiny_models (name -> model dir), load_fixture(name, dtype="float64") -> LoadedModel (fresh load), specrun_cache,
local_ray (one local Ray per test module). Under pytest-xdist (`make test`: two processes) the modules that start Ray
run in one of them, one after another (see pytest_collection_modifyitems).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# name -> build_tiny_model keyword arguments (hidden 64, 2 layers: fast on CPU).
TINY_SPECS: dict[str, dict] = {
    "llama_mha": dict(arch="llama", heads=4, kv_heads=4, tie_embeddings=True, seed=1),
    "llama_gqa": dict(arch="llama", heads=4, kv_heads=2, tie_embeddings=False, seed=2),
    "qwen2": dict(arch="qwen2", heads=4, kv_heads=2, tie_embeddings=False, seed=3),
    "qwen3": dict(arch="qwen3", heads=4, kv_heads=2, tie_embeddings=True, seed=4),
    "mistral": dict(arch="mistral", heads=4, kv_heads=2, tie_embeddings=False, seed=5),
    "llama_bigvocab": dict(arch="llama", heads=4, kv_heads=2, tie_embeddings=False, extra_vocab=37, seed=6),
}


@pytest.fixture(scope="session", autouse=True)
def specrun_cache(tmp_path_factory) -> Path:
    """Points SPECRUN_CACHE at a session tmp dir so tests (and Ray workers they start) never touch ~/.cache."""
    cache = tmp_path_factory.mktemp("specrun-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRUN_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory) -> Path:
    """A module's SPECRUN_CACHE of its own: the compiled layers it builds are not found by a later module's float32
    engines (compile_layers auto loads what is cached)."""
    cache = tmp_path_factory.mktemp("module-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRUN_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Every TINY_SPECS model built offline once per session: name -> model directory (str)."""
    from specrun.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {name: str(build_tiny_model(root / name, **spec)) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def load_fixture(tiny_models):
    """Callable load_fixture(name, dtype="float64", device="cpu") -> a freshly loaded LoadedModel of a tiny model."""
    from specrun.models.loader import load_model

    def load(name: str, dtype: str = "float64", device: str = "cpu"):
        if name not in tiny_models:
            raise KeyError(f"unknown fixture model {name!r}; have {sorted(tiny_models)}")
        return load_model(tiny_models[name], dtype=dtype, device=device)

    return load


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for the test module that asks for it (run_job joins it rather than starting its own each time)."""
    ray = pytest.importorskip("ray")
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=2)
    yield
    ray.shutdown()


# A module that starts Ray (itself, through run_job or local_ray, or in a `specrun submit` or `resume`): such modules
# never overlap (two local Rays, or a `ray start` cluster that another module's ray.init would join, on one machine),
# whatever else runs beside them. Other subprocesses (a `make`, a lock's racers) run beside anything.
_STARTS_RAY = re.compile(r"\bray\b|run_job|local_ray|\"(submit|resume)\"")


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup every test of a module that starts Ray goes to the group "ray"
    (one worker, one test after another); the rest spread over the workers (they run in one thread mostly: the
    machine's other core was idle beside them)."""
    starts: dict[str, bool] = {}
    for item in items:
        path = str(item.path)
        if path not in starts:
            starts[path] = bool(_STARTS_RAY.search(Path(path).read_text()))
        if starts[path]:
            item.add_marker(pytest.mark.xdist_group("ray"))
