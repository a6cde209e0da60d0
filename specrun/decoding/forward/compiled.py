"""The decoder's layers and LM head compiled ahead of time by inductor with the weights frozen in: its C++ GEMM
template reads each prepacked weight once per call; norms, rotary and MLP fuse around it. CPU only. Two packages each,
one row a call and 2 to 64 rows (row_packages.py), built once per machine in the specrun cache and loaded after.

CompiledLayers(decoder)(x, cos, sin, ctx) computes what decoder.layer_stack does; attention stays the context's own
(one opaque op a layer, which the package calls back: its cache writes and masks are the eager ones).
CompiledHead(decoder)(hidden) computes the lm head's logits. A row's products do not depend on the rows beside it (one
K slice, in both packages; bf16 register blocks of at most 4 rows, gemm_blocking.py); torch's attention can, in the
last bits (docs/design.md section 2). A package holds the packed weights only: the model's own are handed to it at load.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from specrun.decoding.forward import aot_package
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv
from specrun.decoding.forward.row_packages import MAX_ROWS, OPTIONS, RowPackages, _key

PREFIX, HEAD_PREFIX = "layers", "head"
SOURCES = ("compiled.py", "decoder.py", "aot_package.py", "gemm_blocking.py", "row_packages.py")  # the code the
# packages trace: a change names new ones
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
    than the eager layers (or head) here (RowPackages.keep_faster)."""
    w = dec.layers[0].qkv.weight
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compiled layers run on the CPU in float32 or bfloat16, not {w.device.type} {w.dtype}")
    if dec.cpu_layers is not None:
        return
    layers, head = _layers(dec), _head(dec)
    layers.warm(max_rows)
    head.warm(max_rows)
    if measured and w.dtype == torch.bfloat16:  # float32's packages ran faster on every host measured; bf16's did not.
        # Untimed, float32's packages serve every row count: a verify's rows get an AR step's logits bit for bit
        layers.keep_faster(dec.layer_stack, max_rows)
        head.keep_faster(dec.lm_head, max_rows)


def eligible(dec) -> bool:
    """Where compile_layers auto compiles: float32 or bfloat16 layers on the CPU that our kernels do not run, a C++
    compiler."""
    w = dec.layers[0].qkv.weight
    compiler = shutil.which(os.environ.get("CXX") or "g++")  # the compiler inductor runs
    return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and dec.cpu_layers is None \
        and compiler is not None


def cached(dec, max_rows: int) -> bool:
    """Whether compile_layers(dec, max_rows) loads every package it needs, building none."""
    return _layers(dec).cached(max_rows) and _head(dec).cached(max_rows)


def _layers(dec) -> CompiledLayers:
    """dec's CompiledLayers, made on first use (its packages loaded or built by warm only)."""
    if dec.compiled is None:
        dec.compiled = CompiledLayers(dec)
    return dec.compiled


def _head(dec) -> CompiledHead:
    """dec's CompiledHead, made on first use."""
    if dec.compiled_head is None:
        dec.compiled_head = CompiledHead(dec)
    return dec.compiled_head


class CompiledLayers(RowPackages):
    """The layers' packages (row_packages.py): forwards of one row (key 1) and of 2 to MAX_ROWS rows (key 0)."""

    inputs = ("x", "cos", "sin")
    what = "the layers"

    def __init__(self, dec):
        super().__init__(_Stack(dec), PREFIX)
        self.hidden = dec.layers[0].o.weight.shape[0]

    def example(self, rows: int) -> tuple[torch.Tensor, ...]:
        w, D = self.module.layers[0].w_qkv, self.module.D
        return w.new_ones(rows, self.hidden), w.new_ones(rows, 1, D), w.new_zeros(rows, 1, D)

    def _pair(self, fn, eager, rows: int) -> tuple:
        """eager (decoder.layer_stack) and the package on the same rows, attention left out (the same op on both
        paths)."""
        x, cos, sin = self.example(rows)
        ctx = _NoAttention()
        return (lambda: eager(x, cos, sin, ctx), lambda: self._run(fn, x, cos, sin, ctx))

    def package_name(self, key: int) -> str:
        """A name for a package of the stack (aot_package.name): its weights, shapes and constants, the traced code,
        the options."""
        stack = self.module
        layers = [(L.scaling, aot_package.act_id(L.act), *map(repr, (L.ln1, L.ln2, L.q_norm, L.k_norm)))
                  for L in stack.layers]  # a norm's repr holds its epsilon
        return aot_package.name(PREFIX, "1" if key else "n", Path(__file__).parent, SOURCES, stack, key, MAX_ROWS,
                                stack.n_q, stack.n_kv, stack.D, stack.inter, layers, OPTIONS)

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


class _Head(torch.nn.Module):
    """The LM head as its packages trace it: the model's weight (and bias) as buffers, the logits in their dtype (the
    caller widens them, as it does the eager head's)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("w", weight)
        self.register_buffer("b", bias)

    def forward(self, x):
        """# x: [R, H] -> [R, V]"""
        return F.linear(x, self.w, self.b)


class CompiledHead(RowPackages):
    """The LM head's packages (row_packages.py), beside the layers': in bf16 the one-row package ran in about half the
    eager head's time (docs/benchmarks.md, stop 84). Used where the layers run compiled (decoder.logits)."""

    what = "the LM head"
    cold = True  # its weights fit a last-level cache while timed alone; in a step the layers' pass through it between

    def __init__(self, dec):
        super().__init__(_Head(dec.lm_head.weight, dec.lm_head.bias), HEAD_PREFIX)

    def example(self, rows: int) -> tuple[torch.Tensor, ...]:
        w = self.module.w
        return (w.new_ones(rows, w.shape[1]),)

    def package_name(self, key: int) -> str:
        return aot_package.name(HEAD_PREFIX, "1" if key else "n", Path(__file__).parent, SOURCES, self.module, key,
                                MAX_ROWS, OPTIONS)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """# hidden: [T, H] -> [T, V] in the model's dtype; T's package loaded (covers)"""
        self.calls += 1
        with torch.no_grad():
            return self._fns[_key(hidden.shape[0])](hidden.contiguous())
