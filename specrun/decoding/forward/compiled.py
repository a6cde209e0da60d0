"""The decoder's layers compiled ahead of time by inductor with the weights frozen in: its C++ GEMM template reads each
prepacked weight once per call; norms, rotary and MLP fuse around it. CPU only. Two packages a model, one row a forward
and 2 to 64 rows, each built once per machine in the specrun cache (aot_package.py) and loaded by later runs.

CompiledLayers(decoder)(x, cos, sin, ctx) computes what decoder.layer_stack does; attention stays the context's own
(one opaque op a layer, which the package calls back: its cache writes and masks are the eager ones), and so does the
lm head (docs/benchmarks.md, stops 47 and 83). A row's products do not depend on the rows beside
it (one K slice, in both packages; bf16 register blocks of at most 4 rows, gemm_blocking.py); torch's attention can,
in the last bits (docs/design.md section 2). A package holds the packed weights only: the model's own are handed to
it at load.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specrun.decoding.forward import aot_package, gemm_blocking
from specrun.decoding.forward.decoder import ROW_BUCKETS, mlp_residual, rotated_qkv, rows_bucket
from specrun.models.cache import cache_root

OPTIONS = {  # inductor: weights as constants (freezing), its C++ GEMM template, one K slice (the order of a row's sum
    # then does not depend on the rows beside it)
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "cpp.gemm_max_k_slices": 1,
}
MAX_ROWS = ROW_BUCKETS[-1]  # rows of the largest forward through the packages; more rows run eagerly
PREFIX = "layers"
SOURCES = ("compiled.py", "decoder.py", "aot_package.py", "gemm_blocking.py")  # the code the packages trace: a change
# names new ones
_current = threading.local()  # the context of the forward in flight (the opaque attention op reads it)


@torch.library.custom_op("specrun::attend", mutates_args=())
def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """# q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]"""
    out = _current.ctx.attend(layer, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                              scaling)  # [1, T, Hq, D]
    return out.reshape(q.shape[0], -1)


@_attend.register_fake
def _(layer, q, k, v, scaling):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class _Layer(torch.nn.Module):
    """One decoder layer as rotated_qkv reads it, its weights as buffers (freezing folds them into the graph)."""

    def __init__(self, L):
        super().__init__()
        self.ln1, self.ln2, self.q_norm, self.k_norm, self.act = L.ln1, L.ln2, L.q_norm, L.k_norm, L.act
        self.scaling = float(L.scaling)
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(L, name)
            self.register_buffer(f"w_{name}", lin.weight)
            self.register_buffer(f"b_{name}", lin.bias)

    def qkv(self, x):
        return F.linear(x, self.w_qkv, self.b_qkv)

    def o(self, x):
        return F.linear(x, self.w_o, self.b_o)

    def gate_up(self, x):
        return F.linear(x, self.w_gate_up, self.b_gate_up)

    def down(self, x):
        return F.linear(x, self.w_down, self.b_down)


class _Stack(torch.nn.Module):
    """decoder.layer_stack over _Layers, attention through the opaque op."""

    def __init__(self, dec):
        super().__init__()
        self.n_q, self.n_kv, self.D, self.inter = dec.n_q, dec.n_kv, dec.head_dim, dec.inter
        self.layers = torch.nn.ModuleList([_Layer(L) for L in dec.layers])

    def forward(self, x, cos, sin):
        """# x: [R, H], cos/sin: [R, 1, D] -> [R, H] (before the final norm)"""
        nq = self.n_q
        for i, L in enumerate(self.layers):
            qk, v = rotated_qkv(L, x, cos, sin, nq, self.n_kv, self.D)
            x = x + L.o(torch.ops.specrun.attend(i, qk[:, :nq], qk[:, nq:], v, L.scaling))
            x = mlp_residual(L, x, self.inter)
        return x


def compile_layers(dec, max_rows: int, measured: bool = False) -> None:
    """Run dec's forwards of up to max_rows rows (1-64) through compiled layers, loading (or building: progress on
    stderr) their packages now. CPU float32 or bfloat16; where our kernels run the layers (dec.cpu_layers) they stay
    the path. measured (compile_layers auto): in bfloat16 a package serves only the row counts at which it ran faster
    than the eager layers here (CompiledLayers.keep_faster)."""
    w = dec.layers[0].qkv.weight
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compiled layers run on the CPU in float32 or bfloat16, not {w.device.type} {w.dtype}")
    if dec.cpu_layers is not None:
        return
    layers = _layers(dec)
    layers.warm(max_rows)
    if measured and w.dtype == torch.bfloat16:  # float32's packages ran faster on every host measured; bf16's did not
        layers.keep_faster(dec.layer_stack, max_rows)


def eligible(dec) -> bool:
    """Where compile_layers auto compiles: float32 or bfloat16 layers on the CPU that our kernels do not run, a C++
    compiler."""
    w = dec.layers[0].qkv.weight
    compiler = shutil.which(os.environ.get("CXX") or "g++")  # the compiler inductor runs
    return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and dec.cpu_layers is None \
        and compiler is not None


def cached(dec, max_rows: int) -> bool:
    """Whether compile_layers(dec, max_rows) loads every package it needs, building none."""
    return _layers(dec).cached(max_rows)


def _layers(dec) -> CompiledLayers:
    """dec's CompiledLayers, made on first use (its packages loaded or built by warm only)."""
    if dec.compiled is None:
        dec.compiled = CompiledLayers(dec)
    return dec.compiled


class CompiledLayers:
    """The layers' packages, one row a forward (key 1) and 2 to MAX_ROWS (key 0), loaded from the cache or built at
    warm-up; `compile_seconds` records what each build took, `load_seconds` each load."""

    def __init__(self, dec):
        self.stack = _Stack(dec).eval()
        self.hidden = dec.layers[0].o.weight.shape[0]
        self.shared = dict(self.stack.state_dict())  # the model's own tensors, by name: the packages keep them apart
        self._fns: dict[int, object] = {}
        self._pool: dict = {}  # the packages' packed weights: both packages pack them alike, one copy serves
        self._paths: dict[int, Path] = {}
        self.compile_seconds: dict[int, float] = {}
        self.load_seconds: dict[int, float] = {}
        self.calls = 0  # forwards run compiled (tests check the engines take this path)
        self.timings: dict[int, tuple[float, float]] = {}  # rows: (eager ms, compiled ms) of keep_faster's forwards
        self.served: dict[int, int] = {}  # key: the most rows a forward through it takes once timed (0: dropped)

    def covers(self, rows: int) -> bool:
        """Whether a forward of `rows` rows has its package loaded (a forward never builds one: warm does)."""
        key = _key(rows)
        return key in self._fns and rows <= self.served.get(key, MAX_ROWS)

    @property
    def dropped(self) -> set[int]:
        """The keys keep_faster dropped: their forwards run eagerly, warm loads them no more."""
        return {key for key, rows in self.served.items() if not rows}

    @property
    def runs(self) -> bool:
        """Whether some forward runs compiled (a package loaded and kept)."""
        return bool(self._fns)

    def cached(self, max_rows: int) -> bool:
        """Whether warm(max_rows) builds nothing: each package it needs is loaded, dropped, or in the cache."""
        return all(k in self._fns or k in self.dropped or self.path(k).is_file() for k in _keys(max_rows))

    def keep_faster(self, eager, max_rows: int = MAX_ROWS, rounds: int = 3) -> None:
        """Time each loaded package not yet timed against eager (decoder.layer_stack) on the same rows, attention left
        out (the same op on both paths): the one-row package on 1 row, the other on 4, 8, ... rows (up to max_rows'
        bucket) until eager wins. A package serves forwards of up to the most rows it won at, the rest run eagerly;
        one that won at none is dropped. Medians of `rounds` interleaved pairs."""
        top = rows_bucket(max(max_rows, ROW_BUCKETS[2])) or MAX_ROWS
        for key in [k for k in self._fns if k not in self.served]:
            self.served[key] = 0
            for R in (1,) if key else [r for r in ROW_BUCKETS[2:] if r <= top]:
                self.timings[R] = self._race(self._fns[key], eager, R, rounds)
                if self.timings[R][1] >= self.timings[R][0]:
                    break
                self.served[key] = R
            if not self.served[key]:
                del self._fns[key]
        if not self._fns:
            self._pool.clear()  # the packed weights: nothing holds them now

    def _race(self, fn, eager, R: int, rounds: int) -> tuple[float, float]:
        """(eager ms, compiled ms) of a forward of R rows: medians of `rounds` pairs after a pair that warms both."""
        w, D = self.stack.layers[0].w_qkv, self.stack.D
        x, cos, sin = w.new_ones(R, self.hidden), w.new_ones(R, 1, D), w.new_zeros(R, 1, D)
        ctx = _NoAttention()
        runs = (lambda: eager(x, cos, sin, ctx), lambda: self._run(fn, x, cos, sin, ctx))
        times: tuple[list[float], list[float]] = ([], [])
        with torch.no_grad():
            for _ in range(rounds + 1):
                for run, spent in zip(runs, times):
                    t0 = time.perf_counter()
                    run()
                    spent.append(time.perf_counter() - t0)
        return statistics.median(times[0][1:]) * 1e3, statistics.median(times[1][1:]) * 1e3

    def path(self, key: int) -> Path:
        """Where the package of key (1: one row a forward, 0: several) lives."""
        if key not in self._paths:  # the name hashes the weights: once a model
            self._paths[key] = cache_root() / "layers" / package_name(self.stack, key)
        return self._paths[key]

    def warm(self, max_rows: int) -> None:
        """Load, or build, every package a forward of up to max_rows rows uses."""
        for key in _keys(max_rows):
            if key in self._fns or key in self.dropped:
                continue
            where, t0 = self.path(key), time.perf_counter()
            fn = aot_package.load(where, self.shared, self._pool)
            if fn is not None:
                self.load_seconds[key] = time.perf_counter() - t0
            else:
                print(f"specrun: compiling the layers for {'one row' if key else 'several rows'} a forward "
                      f"(AOTInductor, a minute or more once per machine and model; cached in {where.parent})",
                      file=sys.stderr, flush=True)
                fn = self._build(key, where)
                self.compile_seconds[key] = time.perf_counter() - t0
            self._fns[key] = fn

    def _build(self, key: int, where: Path):
        R = 1 if key else 4  # the example's rows; the several-rows package takes 2 to MAX_ROWS
        w, D = self.stack.layers[0].w_qkv, self.stack.D
        example = (w.new_zeros(R, self.hidden), w.new_ones(R, 1, D), w.new_zeros(R, 1, D))
        rows = torch.export.Dim("R", min=2, max=MAX_ROWS)
        dims = None if key else {"x": {0: rows}, "cos": {0: rows}, "sin": {0: rows}}
        with torch.inference_mode():  # as the decoder's forwards run
            program = torch.export.export(self.stack, example, dynamic_shapes=dims)
        with gemm_blocking.capped_rows():
            return aot_package.write(program, OPTIONS, where, PREFIX, self.shared, self._pool)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """# x: [T, H], cos/sin: [T, 1, D] -> [T, H] (before the final norm); T's package loaded (covers)"""
        self.calls += 1
        with torch.no_grad():
            return self._run(self._fns[_key(x.shape[0])], x, cos, sin, ctx)

    @staticmethod
    def _run(fn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        _current.ctx = ctx
        try:
            return fn(x.contiguous(), cos.contiguous(), sin.contiguous())
        finally:
            _current.ctx = None


class _NoAttention:
    """A forward context whose attention hands back its queries (keep_faster times what the two paths do not share)."""

    @staticmethod
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        return q.transpose(1, 2).clone()  # [1, Hq, T, D] -> [1, T, Hq, D]; a copy: a custom op's output aliases none


def _key(rows: int) -> int | None:
    """The package of a forward of `rows` rows: 1 (one row), 0 (2 to MAX_ROWS), None (more: eager)."""
    return 1 if rows == 1 else 0 if rows <= MAX_ROWS else None


def _keys(max_rows: int) -> tuple[int, ...]:
    return (1, 0) if max_rows > 1 else (1,)


def package_name(stack: _Stack, key: int) -> str:
    """A name for a package of the stack (aot_package.name): its weights, shapes and constants, the traced code, the
    options."""
    layers = [(L.scaling, aot_package.act_id(L.act), *map(repr, (L.ln1, L.ln2, L.q_norm, L.k_norm)))
              for L in stack.layers]  # a norm's repr holds its epsilon
    return aot_package.name(PREFIX, "1" if key else "n", Path(__file__).parent, SOURCES, stack, key, MAX_ROWS, stack.n_q,
                            stack.n_kv, stack.D, stack.inter, layers, OPTIONS)
