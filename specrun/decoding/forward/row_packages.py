"""A part of the decoder compiled ahead of time by inductor into two packages keyed by rows: one row a call (key 1) and
2 to MAX_ROWS (key 0), each built once per machine in the specrun cache (aot_package.py) and loaded by later runs.

RowPackages(module, prefix) loads or builds them (warm), and where asked times each against the eager part on the same
rows (keep_faster): a package then serves only the row counts at which it won. compiled.py's layers and LM head are it.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from specrun.decoding.forward import aot_package, gemm_blocking
from specrun.decoding.forward.decoder import ROW_BUCKETS, rows_bucket
from specrun.models.cache import cache_root

OPTIONS = {  # inductor: weights as constants (freezing), its C++ GEMM template, one K slice (the order of a row's sum
    # then does not depend on the rows beside it)
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "cpp.gemm_max_k_slices": 1,
}
MAX_ROWS = ROW_BUCKETS[-1]  # rows of the largest call of a package; more rows run eagerly
EVICT_BYTES = 128 << 20  # written between a cold timing's calls: more than a CPU's last-level cache holds


def _key(rows: int) -> int | None:
    """The package of a call of `rows` rows: 1 (one row), 0 (2 to MAX_ROWS), None (more: eager)."""
    return 1 if rows == 1 else 0 if rows <= MAX_ROWS else None


def _keys(max_rows: int) -> tuple[int, ...]:
    return (1, 0) if max_rows > 1 else (1,)


def _evict() -> None:
    """EVICT_BYTES written: what the CPU's caches held is gone."""
    torch.empty(EVICT_BYTES, dtype=torch.uint8).fill_(1)


class RowPackages:
    """A module's packages, loaded from the cache or built at warm-up; `compile_seconds` records what each build took,
    `load_seconds` each load. A subclass names its packages (package_name), its inputs of R rows (example) and what
    it is in messages (what)."""

    inputs: tuple[str, ...] = ("x",)  # the module's forward arguments, each with rows on dim 0
    what = "a part"
    cold = False  # keep_faster evicts the caches before each timed call: weights cached while timed, not in a step

    def __init__(self, module: torch.nn.Module, prefix: str):
        self.module, self.prefix = module.eval(), prefix
        self.shared = dict(module.state_dict())  # the model's own tensors, by name: the packages keep them apart
        self._fns: dict[int, object] = {}
        self._pool: dict = {}  # the packages' packed weights: both packages pack them alike, one copy serves
        self._paths: dict[int, Path] = {}
        self.compile_seconds: dict[int, float] = {}
        self.load_seconds: dict[int, float] = {}
        self.calls = 0  # calls run compiled (tests check the engines take this path)
        self.timings: dict[int, tuple[float, float]] = {}  # rows: (eager ms, compiled ms) of keep_faster's calls
        self.served: dict[int, int] = {}  # key: the most rows a call through it takes once timed (0: dropped)

    def example(self, rows: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def package_name(self, key: int) -> str:
        raise NotImplementedError

    def covers(self, rows: int) -> bool:
        """Whether a call of `rows` rows has its package loaded (a call never builds one: warm does)."""
        key = _key(rows)
        return key in self._fns and rows <= self.served.get(key, MAX_ROWS)

    @property
    def dropped(self) -> set[int]:
        """The keys keep_faster dropped: their calls run eagerly, warm loads them no more."""
        return {key for key, rows in self.served.items() if not rows}

    @property
    def runs(self) -> bool:
        """Whether some call runs compiled (a package loaded and kept)."""
        return bool(self._fns)

    def cached(self, max_rows: int) -> bool:
        """Whether warm(max_rows) builds nothing: each package it needs is loaded, dropped, or in the cache."""
        return all(k in self._fns or k in self.dropped or self.path(k).is_file() for k in _keys(max_rows))

    def keep_faster(self, eager, max_rows: int = MAX_ROWS, rounds: int = 3) -> None:
        """Time each loaded package not yet timed against eager on the same rows (see _pair): the one-row package on
        1 row, the other on 4, 8, ... rows (up to max_rows' bucket) until eager wins. A package serves calls of up to
        the most rows it won at, the rest run eagerly; one that won at none is dropped. Medians of `rounds`
        interleaved pairs."""
        top = rows_bucket(max(max_rows, ROW_BUCKETS[2])) or MAX_ROWS
        for key in [k for k in self._fns if k not in self.served]:
            self.served[key] = 0
            for R in (1,) if key else [r for r in ROW_BUCKETS[2:] if r <= top]:
                self.timings[R] = self._race(self._pair(self._fns[key], eager, R), rounds, self.cold)
                if self.timings[R][1] >= self.timings[R][0]:
                    break
                self.served[key] = R
            if not self.served[key]:
                del self._fns[key]
        if not self._fns:
            self._pool.clear()  # the packed weights: nothing holds them now

    def _pair(self, fn, eager, rows: int) -> tuple:
        """(eager's call, the package's call) on the same inputs of `rows` rows, for keep_faster to time."""
        args = self.example(rows)
        return (lambda: eager(*args), lambda: fn(*args))

    @staticmethod
    def _race(runs: tuple, rounds: int, cold: bool = False) -> tuple[float, float]:
        """(eager ms, compiled ms): medians of `rounds` interleaved pairs after a pair that warms both; cold: the caches
        evicted (untimed) before each call, which then reads its weights from memory as it does in a step."""
        times: tuple[list[float], list[float]] = ([], [])
        with torch.no_grad():
            for _ in range(rounds + 1):
                for run, spent in zip(runs, times):
                    if cold:
                        _evict()
                    t0 = time.perf_counter()
                    run()
                    spent.append(time.perf_counter() - t0)
        return statistics.median(times[0][1:]) * 1e3, statistics.median(times[1][1:]) * 1e3

    def path(self, key: int) -> Path:
        """Where the package of key (1: one row a call, 0: several) lives."""
        if key not in self._paths:  # the name hashes the weights: once a model
            self._paths[key] = cache_root() / self.prefix / self.package_name(key)
        return self._paths[key]

    def warm(self, max_rows: int) -> None:
        """Load, or build, every package a call of up to max_rows rows uses."""
        for key in _keys(max_rows):
            if key in self._fns or key in self.dropped:
                continue
            where, t0 = self.path(key), time.perf_counter()
            fn = aot_package.load(where, self.shared, self._pool)
            if fn is not None:
                self.load_seconds[key] = time.perf_counter() - t0
            else:
                print(f"specrun: compiling {self.what} for {'one row' if key else 'several rows'} a call "
                      f"(AOTInductor, a minute or more once per machine and model; cached in {where.parent})",
                      file=sys.stderr, flush=True)
                fn = self._build(key, where)
                self.compile_seconds[key] = time.perf_counter() - t0
            self._fns[key] = fn

    def _build(self, key: int, where: Path):
        rows = torch.export.Dim("R", min=2, max=MAX_ROWS)
        dims = None if key else {name: {0: rows} for name in self.inputs}
        with torch.inference_mode():  # as the decoder's forwards run
            program = torch.export.export(self.module, self.example(1 if key else 4), dynamic_shapes=dims)
        with gemm_blocking.capped_rows():
            return aot_package.write(program, OPTIONS, where, self.prefix, self.shared, self._pool)
