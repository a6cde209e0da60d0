"""The decoder's layers compiled by inductor per row bucket (1, 2, 4, ... 64 rows) with the weights frozen in: its
C++ GEMM template reads each prepacked weight once per call; norms, rotary and MLP fuse around it. CPU only.

CompiledLayers(decoder)(x, cos, sin, ctx) computes what decoder.layer_stack does; attention stays the context's own
(one opaque op a layer: its cache writes and masks are the eager ones), and so does the lm head (compiled, it ran no
faster at one row and 3x slower at 8 on smollm2). A row's products do not depend on its bucket (one K slice); torch's
attention can, in the last bits (docs/design.md section 2). The frozen weights are a copy beside the model's.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
import torch._dynamo.config
import torch._inductor.config
import torch.nn.functional as F

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # row counts compiled; a forward of more rows runs eagerly
OPTIONS = {  # inductor: weights as constants (freezing), its C++ GEMM template, one K slice (the order of a row's sum
    # then does not depend on the rows beside it)
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "cpp.gemm_max_k_slices": 1,
}

RECOMPILES = 64  # compiled entries per forward code object: buckets x models in one process
_current = threading.local()  # the context of the forward in flight (the opaque attention op reads it)


@torch.library.custom_op("specrun::attend", mutates_args=())
def _attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """# q: [R, Hq, D], k/v: [R, Hkv, D] (R rows of a bucket, the first T real) -> [R, Hq * D]"""
    ctx, T = _current.ctx, _current.rows
    out = ctx.attend(layer, q[:T].transpose(0, 1)[None], k[:T].transpose(0, 1)[None], v[:T].transpose(0, 1)[None],
                     scaling)  # [1, T, Hq, D]
    full = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    full[:T] = out.reshape(T, -1)
    return full


@_attend.register_fake
def _(layer, q, k, v, scaling):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _rope(x, cos, sin):
    """# x: [R, Hx, D], cos/sin: [R, 1, D] -> [R, Hx, D]"""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Stack(torch.nn.Module):
    """The layers as one module whose weights are buffers (freezing folds them into the compiled graph)."""

    def __init__(self, dec):
        super().__init__()
        self.n_q, self.n_kv, self.D, self.inter = dec.n_q, dec.n_kv, dec.head_dim, dec.inter
        self.ln1 = torch.nn.ModuleList([L.ln1 for L in dec.layers])
        self.ln2 = torch.nn.ModuleList([L.ln2 for L in dec.layers])
        self.q_norm = torch.nn.ModuleList([L.q_norm or torch.nn.Identity() for L in dec.layers])
        self.k_norm = torch.nn.ModuleList([L.k_norm or torch.nn.Identity() for L in dec.layers])
        self.acts = [L.act for L in dec.layers]
        self.scaling = [float(L.scaling) for L in dec.layers]
        self.has_qk_norm = dec.layers[0].q_norm is not None
        for i, L in enumerate(dec.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                lin = getattr(L, name)
                self.register_buffer(f"w{i}_{name}", lin.weight)
                self.register_buffer(f"b{i}_{name}", lin.bias)

    def _lin(self, i: int, name: str, x):
        return F.linear(x, getattr(self, f"w{i}_{name}"), getattr(self, f"b{i}_{name}"))

    def forward(self, x, cos, sin):
        """# x: [R, H], cos/sin: [R, 1, D] -> [R, H] (before the final norm)"""
        R, D, nq, nkv = x.shape[0], self.D, self.n_q, self.n_kv
        for i in range(len(self.ln1)):
            qkv = self._lin(i, "qkv", self.ln1[i](x))
            qk = qkv[:, : (nq + nkv) * D].view(R, nq + nkv, D)
            v = qkv[:, (nq + nkv) * D :].view(R, nkv, D)
            if self.has_qk_norm:
                qk = torch.cat((self.q_norm[i](qk[:, :nq]), self.k_norm[i](qk[:, nq:])), dim=1)
            qk = _rope(qk, cos, sin)
            out = torch.ops.specrun.attend(i, qk[:, :nq], qk[:, nq:], v, self.scaling[i])
            x = x + self._lin(i, "o", out)
            gu = self._lin(i, "gate_up", self.ln2[i](x))
            x = x + self._lin(i, "down", self.acts[i](gu[:, : self.inter]) * gu[:, self.inter :])
        return x


def announce_compile(rows: int) -> None:
    """Progress on stderr: a bucket's compile takes a minute or more on a small model, two CPU threads."""
    print(f"specrun: compiling the layers for {rows} row(s) a forward (torch.compile, once per process)",
          file=sys.stderr, flush=True)


def bucket_of(rows: int) -> int | None:
    """The smallest bucket holding `rows` rows, None past the largest."""
    return next((b for b in BUCKETS if b >= rows), None)


class _NoAttention:
    """The context of a warm-up forward: attends nothing, writes no cache (compiling needs shapes, not values)."""

    def attend(self, layer, q, k, v, scaling):
        return q.new_zeros(1, q.shape[2], q.shape[1], q.shape[3])


class CompiledLayers:
    """Per bucket the layers compiled once, at warm-up (inductor's graph cache skips graphs with frozen
    weights, so every process compiles again); `compile_seconds` records what each bucket took."""

    def __init__(self, dec):
        self.stack = _Stack(dec).eval()
        self.hidden = dec.layers[0].o.weight.shape[0]
        self._fns: dict[int, object] = {}
        self.compile_seconds: dict[int, float] = {}
        self.calls = 0  # forwards run compiled (tests check the engines take this path)

    def covers(self, rows: int) -> bool:
        """Whether a forward of `rows` rows has its bucket compiled (a forward never compiles one: warm does)."""
        return bucket_of(rows) in self._fns

    def warm(self, max_rows: int, progress=None) -> None:
        """Compile every bucket a forward of up to max_rows rows uses; progress(bucket) is called before each."""
        w = self.stack.w0_qkv
        for R in BUCKETS:
            if R > 1 and R // 2 >= max_rows:
                break
            if R not in self._fns:
                if progress is not None:
                    progress(R)
                with torch.inference_mode():  # as the decoder's forwards run (dynamo guards on it)
                    x = w.new_zeros(R, self.hidden)
                    cos, sin = w.new_ones(R, 1, self.stack.D), w.new_zeros(R, 1, self.stack.D)  # apart: dynamo
                    # guards on aliasing
                    self(x, cos, sin, _NoAttention())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """# x: [T, H], cos/sin: [T, 1, D] -> [T, H] (before the final norm), T <= BUCKETS[-1]"""
        T = x.shape[0]
        R = bucket_of(T)
        if R != T:  # pad to the bucket: padded rows attend nothing and are dropped
            x = torch.cat((x, x.new_zeros(R - T, x.shape[1])))
            cos = torch.cat((cos, cos[-1:].expand(R - T, -1, -1)))
            sin = torch.cat((sin, sin[-1:].expand(R - T, -1, -1)))
        fn = self._fns.get(R)
        _current.ctx, _current.rows = ctx, T
        try:
            with torch.no_grad():
                if fn is not None:
                    self.calls += 1
                    return fn(x, cos, sin)[:T]
                t0 = time.perf_counter()
                self._fns[R], out = self._compiled(self.stack, x, cos, sin)
                self.compile_seconds[R] = time.perf_counter() - t0
                return out[:T]
        finally:
            _current.ctx = None

    @staticmethod
    def _compiled(module, *inputs):
        """(module compiled for these inputs' shapes, its output for them)."""
        fn = torch.compile(module, dynamic=False, fullgraph=True)
        # a config patch, not torch.compile's options: freezing is decided outside the options' scope; every
        # model's stack shares one forward code object, whose compiled entries dynamo caps (8 by default)
        with torch.no_grad(), torch._inductor.config.patch(OPTIONS), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILES):
            return fn, fn(*inputs)
