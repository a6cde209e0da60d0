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

from specrun.decoding.forward.decoder import ROW_BUCKETS as BUCKETS  # row counts compiled; more rows run eagerly
from specrun.decoding.forward.decoder import mlp_residual, rotated_qkv
from specrun.decoding.forward.decoder import rows_bucket as bucket_of

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
    if T == q.shape[0]:
        return out.reshape(T, -1)
    full = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])
    full[:T] = out.reshape(T, -1)
    return full


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


def compile_layers(dec, max_rows: int) -> None:
    """Run dec's forwards of up to max_rows rows (1-64) through compiled layers, compiling them now (progress on
    stderr). CPU float32 or bfloat16; where our kernels run the layers (dec.cpu_layers) they stay the path."""
    w = dec.layers[0].qkv.weight
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compiled layers run on the CPU in float32 or bfloat16, not {w.device.type} {w.dtype}")
    if dec.cpu_layers is not None:
        return
    if dec.compiled is None:
        dec.compiled = CompiledLayers(dec)
    dec.compiled.warm(max_rows)


def announce_compile(rows: int) -> None:
    """Progress on stderr: a bucket's compile takes a minute or more on a small model, two CPU threads."""
    print(f"specrun: compiling the layers for {rows} row(s) a forward (torch.compile, once per process)",
          file=sys.stderr, flush=True)


class _NoAttention:
    """The context of a warm-up forward: attends nothing, writes no cache (compiling needs shapes, not values)."""

    def attend(self, layer, q, k, v, scaling):
        return q.new_zeros(1, q.shape[2], q.shape[1], q.shape[3])


class CompiledLayers:
    """Per bucket the layers compiled once, at warm-up (inductor's graph cache bypasses them: freezing's mkldnn-packed
    weights do not pickle, so every process compiles again); `compile_seconds` records what each bucket took."""

    def __init__(self, dec):
        self.stack = _Stack(dec).eval()
        self.hidden = dec.layers[0].o.weight.shape[0]
        self._fns: dict[int, object] = {}
        self.compile_seconds: dict[int, float] = {}
        self.calls = 0  # forwards run compiled (tests check the engines take this path)

    def covers(self, rows: int) -> bool:
        """Whether a forward of `rows` rows has its bucket compiled (a forward never compiles one: warm does)."""
        return bucket_of(rows) in self._fns

    def warm(self, max_rows: int) -> None:
        """Compile every bucket a forward of up to max_rows rows uses."""
        w = self.stack.layers[0].w_qkv
        for R in BUCKETS:
            if R > 1 and R // 2 >= max_rows:
                break
            if R in self._fns:
                continue
            announce_compile(R)
            t0 = time.perf_counter()
            fn = torch.compile(self.stack, dynamic=False, fullgraph=True)
            # a config patch, not torch.compile's options: freezing is decided outside the options' scope; every
            # model's stack shares one forward code object, whose compiled entries dynamo caps (8 by default)
            with torch.inference_mode(), torch._inductor.config.patch(OPTIONS), \
                    torch._dynamo.config.patch(recompile_limit=RECOMPILES):  # inference mode: as the decoder's
                # forwards run (dynamo guards on it); cos and sin apart (it guards on aliasing too)
                x, cos, sin = w.new_zeros(R, self.hidden), w.new_ones(R, 1, self.stack.D), w.new_zeros(R, 1, self.stack.D)
                self._run(fn, x, cos, sin, _NoAttention(), R)
            self._fns[R], self.compile_seconds[R] = fn, time.perf_counter() - t0

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx) -> torch.Tensor:
        """# x: [T, H], cos/sin: [T, 1, D] -> [T, H] (before the final norm); T's bucket compiled (covers)"""
        T = x.shape[0]
        R = bucket_of(T)
        if R != T:  # pad to the bucket: padded rows attend nothing and are dropped
            x = torch.cat((x, x.new_zeros(R - T, x.shape[1])))
            cos = torch.cat((cos, cos[-1:].expand(R - T, -1, -1)))
            sin = torch.cat((sin, sin[-1:].expand(R - T, -1, -1)))
        self.calls += 1
        return self._run(self._fns[R], x, cos, sin, ctx, T)[:T]

    @staticmethod
    def _run(fn, x, cos, sin, ctx, T: int) -> torch.Tensor:
        """fn's output for the bucket's rows, the opaque attention op answering the first T through ctx."""
        _current.ctx, _current.rows = ctx, T
        try:
            with torch.no_grad():
                return fn(x, cos, sin)
        finally:
            _current.ctx = None
