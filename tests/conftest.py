"""Shared fixtures: tiny offline models (built once per session into a tmp dir) and a private SPECRUN_CACHE.

Fixtures: tiny_models (name -> model dir), load_fixture(name, dtype="float64") -> LoadedModel (fresh load), specrun_cache,
build_once (each compiled package built once per process), local_ray (one local Ray per test module). Under
pytest-xdist (`make test`: two processes) each module runs in one of them (see pytest_collection_modifyitems).
"""

from __future__ import annotations

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


@pytest.fixture(scope="session")
def _kept_packages(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kept-packages")


@pytest.fixture
def build_once(monkeypatch, _kept_packages) -> None:
    """aot_package.write of a package this process built before (the same name: the same traced code, weights, shapes
    and inductor options) puts a copy of that build in place and loads it instead of compiling the graph again: tests
    that start from an empty cache to watch a build still see one (their callers' counts and messages unchanged)."""
    import shutil

    from specrun.decoding.forward import aot_package
    from specrun.storage.atomic import atomic_path

    real = aot_package.write

    def copy(src: Path, dst: Path) -> None:
        with atomic_path(dst, durable=False) as tmp:
            shutil.copyfile(src, tmp)

    def write(program, options, where, prefix, shared=None, pool=None):
        kept = _kept_packages / where.name
        if kept.exists():
            copy(kept, where)
            fn = aot_package.load(where, shared, pool)
            if fn is not None:
                return fn
        fn = real(program, options, where, prefix, shared, pool)
        copy(where, kept)
        return fn

    monkeypatch.setattr(aot_package, "write", write)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for the test module that asks for it (run_job joins it rather than starting its own each time)."""
    ray = pytest.importorskip("ray")
    from specrun.actors.pool import init_ray

    init_ray(None, num_cpus=2)
    yield
    ray.shutdown()


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's --dist loadgroup each module's tests run in one process, one after another: a module's
    fixtures (a model loaded, its packages compiled, a local Ray started) are made once, never twice at once in both.
    Modules run beside each other, Ray's among them (each local Ray or `ray start` cluster has its own ports and
    temporary directory)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))
