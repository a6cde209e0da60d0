"""Linear layers of the decode step: on CPU in bf16/fp16 the weight is reordered once into oneDNN's blocked layout.

F.linear runs the same oneDNN kernel there but reorders the weight at every call: prepacked, 1-16 rows run 1.4-3x
faster with the same results. On CPUs with AVX-512 BF16 our own kernel (cpu_kernels.c, its own packed copy) runs every
width in bf16 and float32: a row's result does not depend on the others, and 1-8 rows cost about what 1 row does (bf16:
1-2 rows read the weights ~1.4x faster than oneDNN; float32: 3-6x faster than F.linear on smollm2's shapes, whose
summation order it does not share, so float32 logits equal HF's only to rounding). Elsewhere (float64, fp16 without
oneDNN, CUDA) it is plain F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrun.decoding.cpu_kernels import CpuKernels, cpu_kernels

_PACKED_DTYPES = (torch.bfloat16, torch.float16)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of weight [N, K], or None where F.linear is the path (packing fails: F.linear serves)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, supported[weight.dtype], None)
    try:
        if check is None or not check():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
    except (RuntimeError, AttributeError):
        return None


class Linear:
    """y = x W^T + b over a fixed weight; `weight` stays the plain [N, K] tensor for whoever reads it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias  # [N, K], [N] or None
        self._kernels = cpu_kernels() if CpuKernels.packs(weight) else None
        if self._kernels is not None:
            self._packed, self._own = None, self._kernels.pack(weight.detach())
            self._bias32 = None if bias is None else bias.detach().float().contiguous()
        else:
            self._packed, self._own = prepack(weight), None

    @classmethod
    def of(cls, module: torch.nn.Module) -> Linear:
        bias = getattr(module, "bias", None)
        return cls(module.weight.detach(), None if bias is None else bias.detach())

    @property
    def packed(self) -> bool:
        return self._packed is not None or self._own is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """# x: [..., K] -> [..., N]"""
        rows = x.reshape(-1, x.shape[-1])
        if self._own is not None and x.dtype == self._own.dtype:
            y = self._kernels.gemv(rows, self._own, self.weight.shape[0], self._bias32)
        elif self._packed is None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])
