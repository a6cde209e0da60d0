"""Our CPU kernel (cpu_kernels.c): the float64 product rounded once to bf16, the same for a row whatever runs beside it,
and a clean fallback to torch's path where it cannot be built."""

import pytest
import torch

import specrun.decoding.cpu_kernels as ck
from specrun.decoding.linear import GEMV_ROWS, Linear

kernels = ck.cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")


def _operands(M, N, K, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


@needs_kernels
@pytest.mark.parametrize("M,N,K", [(1, 8, 32), (1, 97, 48), (2, 64, 576), (3, 7, 100), (2, 1, 1), (1, 4100, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_exact_product_rounded_once(M, N, K, bias):
    x, w, b = _operands(M, N, K, bias)
    y = kernels.gemv_bf16(x, w, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())  # [M, N]
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    # bf16 products are exact in float32; their float32 sum is off by at most K * 2^-24 * sum |x w|, and the final
    # rounding to bf16 adds at most one bf16 step (2^-7 relative) of the sum
    err = K * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    step = (exact.abs() + err).clamp_min(1e-30).log2().floor().exp2() * 2**-7
    assert ((y.double() - exact).abs() <= err + step).all()


@needs_kernels
def test_a_row_does_not_depend_on_its_neighbours_or_the_threads():
    x, w, b = _operands(5, 203, 576, True, seed=1)
    together = kernels.gemv_bf16(x, w, b)
    for m in range(5):
        assert torch.equal(kernels.gemv_bf16(x[m : m + 1], w, b), together[m : m + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.gemv_bf16(x, w, b), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_linear_takes_the_kernel_for_narrow_inputs_only():
    x, w, _ = _operands(GEMV_ROWS + 2, 96, 64, False, seed=2)
    b = torch.randn(96).bfloat16()
    lin = Linear(w, b)
    narrow = x[:GEMV_ROWS]
    assert torch.equal(lin(narrow), kernels.gemv_bf16(narrow, w, b.float()))
    assert torch.equal(lin(narrow[None])[0], lin(narrow))  # leading dims folded into rows
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-2, atol=1e-2)
    assert Linear(w.float())._kernels is None and Linear(w.half())._kernels is None  # float32/fp16: torch's paths


def test_switched_off_or_unbuildable_means_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRUN_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "cpu_has_bf16_dot", lambda: True)
    try:
        ck.cpu_kernels.cache_clear()
        monkeypatch.setenv("SPECRUN_CPU_KERNELS", "0")
        assert ck.cpu_kernels() is None
        ck.cpu_kernels.cache_clear()
        monkeypatch.delenv("SPECRUN_CPU_KERNELS")
        monkeypatch.setenv("CC", "false")  # a compiler that always fails
        with pytest.warns(UserWarning, match="CPU kernels are off"):
            assert ck.cpu_kernels() is None
        assert not list((tmp_path / "kernels").glob("*"))  # no half-written library left behind
    finally:
        ck.cpu_kernels.cache_clear()


def test_build_is_cached_and_atomic(monkeypatch, tmp_path):
    if ck.shutil.which("cc") is None and ck.shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(ck, "FLAGS", ("-O2", "-shared", "-fPIC"))
    first = ck.build(src, tmp_path / "out")
    mtime = first.stat().st_mtime_ns
    assert ck.build(src, tmp_path / "out") == first and first.stat().st_mtime_ns == mtime  # built once
    assert [p.name for p in (tmp_path / "out").iterdir()] == [first.name]
    src.write_text("int answer(void) { return 43; }\n")
    assert ck.build(src, tmp_path / "out") != first  # a changed source is a new library
