"""Linear layers of the decode step: on CPU the weight is reordered once into oneDNN's blocked layout.

F.linear runs oneDNN (bf16) or MKL (float32) and, in bf16, reorders the weight at every call: prepacked, 1-16 rows run
1.4-3x faster. In float32 the prepacked product also computes each row alone (a row's result does not depend on how
many rows the call carries, which F.linear's does not keep on AVX2 CPUs), so a verify of many rows gives a token the
logits of its AR step; on smollm2's shapes (2 threads, AVX2) 1 row runs ~1.3x and 4-8 rows ~2x faster than F.linear.
On CPUs with AVX-512 BF16 our own kernel (cpu_kernels.c, its own packed copy) runs every width in bf16 and float32.
Float32 results equal F.linear's only to rounding on both paths. Elsewhere (float64, no oneDNN, CUDA) it is F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specrun.decoding.kernels.cpu_kernels import CpuKernels, cpu_kernels

_PACKED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of weight [N, K], or None where F.linear is the path (packing fails: F.linear serves)."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    supported = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    check = getattr(torch.ops.mkldnn, supported[weight.dtype], None) if weight.dtype in supported else lambda: True
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
