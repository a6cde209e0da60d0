"""The decode step's Linear: F.linear's results (within rounding where our CPU kernel runs), prepacked where it pays."""

import pytest
import torch
import torch.nn.functional as F

from specrun.decoding.cpu_kernels import cpu_kernels
from specrun.decoding.linear import Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (17, 48), (2, 5, 48)])
def test_bf16_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 48, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16() if bias else None
    x = torch.randn(*shape, generator=g).bfloat16()
    lin = Linear(w, b)
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert lin.packed  # where oneDNN runs bf16 the step must take the prepacked path (else only speed is lost)
    y = lin(x)
    assert y.shape == (*shape[:-1], 96) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-2, atol=1e-2)


def test_float32_is_our_kernel_where_it_runs_else_plain_f_linear():
    w, x = torch.randn(32, 16), torch.randn(5, 16)
    lin = Linear(w)
    if cpu_kernels() is None:
        assert not lin.packed and torch.equal(lin(x), F.linear(x, w))
    else:  # its own summation order: F.linear's result within float32 rounding, the same for a row whatever runs beside it
        assert lin.packed and torch.equal(lin(x[2:3]), lin(x)[2:3])
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-6, atol=1e-6)
    assert torch.equal(Linear(w.double())(x.double()), F.linear(x.double(), w.double()))  # float64: always F.linear


def test_of_module_keeps_weight_and_bias():
    m = torch.nn.Linear(8, 4).bfloat16()
    lin = Linear.of(m)
    assert lin.weight.data_ptr() == m.weight.data_ptr() and lin.bias is not None
    x = torch.randn(2, 8).bfloat16()
    torch.testing.assert_close(lin(x), m(x).detach(), rtol=1e-2, atol=1e-2)
