"""The decode step's Linear: F.linear's results (within rounding where our CPU kernel runs), prepacked where it pays."""

import pytest
import torch
import torch.nn.functional as F

from specrun.decoding.forward.linear import Linear
from specrun.decoding.kernels.cpu_kernels import cpu_kernels


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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(32, 16), (259, 128), (3072, 576)])
def test_float32_rows_do_not_depend_on_the_rows_beside_them(n, k, bias):
    """Float32 runs our kernel where it runs, else oneDNN's prepacked product (else plain F.linear): F.linear's result
    within rounding, and where packed each row's result is the one it gets alone, whatever the number of rows (a
    verify forward's token then gets its AR step's logits: drafting reproduces AR decoding exactly)."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g), torch.randn(40, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    lin = Linear(w, b)
    if cpu_kernels() is None and not torch.backends.mkldnn.is_available():
        assert not lin.packed and torch.equal(lin(x), F.linear(x, w, b))
        return
    assert lin.packed
    alone = torch.cat([lin(x[r : r + 1]) for r in range(40)])
    for rows in (*range(2, 18), 32, 40):
        assert torch.equal(lin(x[:rows]), alone[:rows]), rows
    torch.testing.assert_close(alone, F.linear(x, w, b), rtol=1e-5, atol=1e-5 * k**0.5)


def test_float64_is_plain_f_linear():
    w, x = torch.randn(32, 16).double(), torch.randn(5, 16).double()
    assert torch.equal(Linear(w)(x), F.linear(x, w))


def test_of_module_keeps_weight_and_bias():
    m = torch.nn.Linear(8, 4).bfloat16()
    lin = Linear.of(m)
    assert lin.weight.data_ptr() == m.weight.data_ptr() and lin.bias is not None
    x = torch.randn(2, 8).bfloat16()
    torch.testing.assert_close(lin(x), m(x).detach(), rtol=1e-2, atol=1e-2)
