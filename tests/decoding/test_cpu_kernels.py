"""Our CPU kernels (cpu_kernels.c): the float64 product within float32 accumulation error (bf16: rounded once), the same
for a row whatever runs beside it, and a clean fallback to torch's path where they cannot be built."""

import pytest
import torch

import specrun.decoding.kernels.cpu_kernels as ck
import specrun.decoding.kernels.kernel_build as kb
from specrun.decoding.forward.linear import Linear

kernels = ck.cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None, reason="this CPU has no AVX-512 BF16 (or no C compiler)")


def _operands(M, N, K, bias, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


@needs_kernels
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (1, 97, 48), (2, 64, 576), (3, 7, 100), (2, 1, 2), (1, 4100, 1536),
                                   (9, 40, 20), (17, 33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_bf16_is_the_exact_product_rounded_once(M, N, K, bias):
    x, w, b = _operands(M, N, K, bias)
    y = kernels.gemv(x, kernels.pack(w), N, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())  # [M, N]
    assert y.shape == (M, N) and y.dtype == torch.bfloat16
    # bf16 products are exact in float32; their float32 sum is off by at most K * 2^-24 * sum |x w|, and the final
    # rounding to bf16 adds at most one bf16 step (2^-7 relative) of the sum
    err = K * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    step = (exact.abs() + err).clamp_min(1e-30).log2().floor().exp2() * 2**-7
    assert ((y.double() - exact).abs() <= err + step).all()


@needs_kernels
@pytest.mark.parametrize("N", [16, 97, 4100])  # 1, 7 (odd: one block streams alone) and 257 column blocks
def test_gemv_bf16_row_alone_equals_the_row_among_others(N):
    """A row alone (two column blocks streamed at once) gets the values it gets in a pass of 5 rows, bit for bit."""
    x, w, b = _operands(5, N, 576, bias=True, seed=N)
    packed = kernels.pack(w)
    rows = kernels.gemv(x, packed, N, b)
    for m in range(5):
        assert torch.equal(kernels.gemv(x[m : m + 1], packed, N, b), rows[m : m + 1])


@needs_kernels
@pytest.mark.parametrize("M,N,K", [(1, 16, 32), (1, 97, 47), (2, 64, 576), (3, 7, 100), (1, 4100, 1536), (9, 40, 20),
                                   (17, 33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_f32_is_the_exact_product_within_float32_rounding(M, N, K, bias):
    x, w, b = _operands(M, N, K, bias, dtype=torch.float32)
    y = kernels.gemv(x, kernels.pack(w), N, b)
    exact = x.double() @ w.double().T + (0 if b is None else b.double())  # [M, N]
    assert y.shape == (M, N) and y.dtype == torch.float32
    # K fused multiply-adds and the bias: each rounds once, by at most 2^-24 of a partial sum bounded by sum |x w| + |b|
    err = (K + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs()))
    assert ((y.double() - exact).abs() <= err).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [12, 19, 24, 25])  # bf16: one pass of 12, 16 + 3, 16 + 8, then passes of 8; float32: 8s
def test_a_row_does_not_depend_on_its_neighbours_or_the_threads(dtype, M):
    x, w, b = _operands(M, 203, 576, True, seed=1, dtype=dtype)
    packed = kernels.pack(w)
    together = kernels.gemv(x, packed, 203, b)
    for m in range(M):
        assert torch.equal(kernels.gemv(x[m : m + 1], packed, 203, b), together[m : m + 1])
    assert torch.equal(kernels.gemv(x[5:9], packed, 203, b), together[5:9])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.gemv(x, packed, 203, b), together)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_linear_takes_the_kernel_in_bf16_and_float32(dtype, tol):
    x, w, _ = _operands(6, 96, 64, False, seed=2, dtype=dtype)
    b = torch.randn(96).to(dtype)
    lin = Linear(w, b)
    assert lin.packed and torch.equal(lin(x), kernels.gemv(x, kernels.pack(w), 96, b.float()))
    assert torch.equal(lin(x.view(2, 3, 64)), lin(x).view(2, 3, 96))  # leading dims folded into rows
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=tol, atol=tol)


@needs_kernels
def test_linear_leaves_fp16_float64_and_odd_bf16_to_torch():
    _, w, _ = _operands(6, 96, 64, False, seed=2)
    assert Linear(w.half())._kernels is None and Linear(w.double())._kernels is None
    assert Linear(w[:, :63].contiguous())._kernels is None  # odd K in bf16: oneDNN


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
    if kb.shutil.which("cc") is None and kb.shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    src = tmp_path / "k.c"
    src.write_text("int answer(void) { return 42; }\n")
    monkeypatch.setattr(kb, "FLAGS", ("-O2", "-shared", "-fPIC"))
    first = kb.build(src, tmp_path / "out")
    mtime = first.stat().st_mtime_ns
    assert kb.build(src, tmp_path / "out") == first and first.stat().st_mtime_ns == mtime  # built once
    assert [p.name for p in (tmp_path / "out").iterdir()] == [first.name]
    src.write_text("int answer(void) { return 43; }\n")
    assert kb.build(src, tmp_path / "out") != first  # a changed source is a new library


def _attention_reference(q, k, v, start, mask, scale):
    """float64 softmax(q k^T) v over the prefix and the new slots mask lets a row see. # -> [T, Hq, D]"""
    T, Hq, D = q.shape
    G = Hq // k.shape[0]
    out = torch.empty(T, Hq, D, dtype=torch.float64)
    for t in range(T):
        seen = torch.arange(start + T) < start
        seen[start:] = torch.ones(T, dtype=torch.bool) if mask is None else mask[t]
        for h in range(Hq):
            keys, values = k[h // G, : start + T][seen].double(), v[h // G, : start + T][seen].double()
            out[t, h] = torch.softmax(keys @ q[t, h].double() * scale, 0) @ values
    return out


def _cache(Hkv, cap, D, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(Hkv, cap, D, generator=g).to(dtype), torch.randn(Hkv, cap, D, generator=g).to(dtype)


def _tree(T: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, T)]
    mask = torch.eye(T, dtype=torch.bool)
    for j in range(1, T):
        mask[j] |= mask[parents[j]]  # a row sees its ancestors
    return mask


DTYPES = pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])


@needs_kernels
@DTYPES
@pytest.mark.parametrize("Hq,Hkv,D,start", [(9, 3, 64, 37), (4, 4, 32, 0), (8, 2, 128, 300), (9, 3, 64, 1100),
                                            (8, 2, 128, 511)])
@pytest.mark.parametrize("mask", [None, [[1, 0], [1, 1]], [[1, 0], [0, 1]]])
def test_attention_matches_float64_reference(Hq, Hkv, D, start, mask, dtype, tol):
    mask = None if mask is None else torch.tensor(mask, dtype=torch.bool)
    T = 1 if mask is None else mask.shape[0]
    k, v = _cache(Hkv, start + T + 5, D, seed=start, dtype=dtype)  # 5 spare slots past the new tokens: never read
    k[:, start + T :] = v[:, start + T :] = float("nan")
    q = torch.randn(T, Hq, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    out = kernels.attend(q, k, v, start, mask, D**-0.5)
    assert out.shape == (T, Hq, D) and out.dtype == dtype
    torch.testing.assert_close(out.double(), _attention_reference(q, k, v, start, mask, D**-0.5), atol=tol, rtol=tol)


@needs_kernels
@DTYPES
@pytest.mark.parametrize("T", [6, 23])
def test_wide_attention_matches_the_reference_and_rows_are_independent(T, dtype, tol):
    """A tree mask over T new tokens (rows in blocks of 16 lanes per KV head: 18 and 69 rows): the float64 reference,
    and each row's output unchanged when every other row's query changes."""
    g = torch.Generator().manual_seed(T)
    mask = _tree(T, g)
    k, v = _cache(3, 50 + T, 64, seed=T, dtype=dtype)
    q = torch.randn(T, 9, 64, generator=g).to(dtype)
    out = kernels.attend(q, k, v, 50, mask, 0.125)
    torch.testing.assert_close(out.double(), _attention_reference(q, k, v, 50, mask, 0.125), atol=tol, rtol=tol)
    for t in (0, T // 2, T - 1):
        other = torch.randn(T, 9, 64, generator=g).to(dtype)
        other[t] = q[t]
        assert torch.equal(kernels.attend(other, k, v, 50, mask, 0.125)[t], out[t])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("start", [40, 509, 1022, 1535])
def test_attention_row_is_the_same_alone_or_beside_another(dtype, start):
    """A chain of 4 new rows (a verify) gives each row exactly what it gets alone once its ancestors are committed (an
    AR step), at short and long contexts (across 512, 1024 and 1536 keys); and the same on one thread. The chain's 12
    rows a KV head take the queries-in-lanes path, a row alone (3 a KV head) the keys-in-lanes one."""
    k, v = _cache(3, start + 8, 64, seed=3, dtype=dtype)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    chain = torch.ones(4, 4, dtype=torch.bool).tril()
    rows = kernels.attend(q, k, v, start, chain, 0.125)
    for d in range(4):  # row d sees the prefix and rows 0..d: an AR step after start + d committed slots
        assert torch.equal(kernels.attend(q[d : d + 1], k, v, start + d, None, 0.125), rows[d : d + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.attend(q, k, v, start, chain, 0.125), rows)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("start,T", [(2047, 1), (5000, 1), (2100, 4), (3000, 13)])
def test_many_keys_shared_between_threads_give_each_row_the_numbers_of_one_thread(dtype, Hq, Hkv, D, start, T):
    """From 1,024 keys, blocks that do not divide among the threads are shared (chunks of keys, then passes of rows
    and slices of columns): on 2, 3 and 4 threads every output bit for bit what one thread gives, and a tree's rows
    what each gets alone as an AR step once its ancestors are committed."""
    g = torch.Generator().manual_seed(start + T)
    k, v = _cache(Hkv, start + T + 4, D, seed=start, dtype=dtype)
    q = torch.randn(T, Hq, D, generator=g).to(dtype)
    mask = _tree(T, g) if T > 1 else None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.attend(q, k, v, start, mask, D**-0.5)
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(kernels.attend(q, k, v, start, mask, D**-0.5), alone), n
        if T > 1:  # the chain 0 -> 1 -> ... of the tree's first rows that form one, committed in place
            chain = [0] + [j for j in range(1, T) if mask[j, j - 1] and mask[j].sum() == j + 1]
            chain = chain[: next((i for i, j in enumerate(chain) if j != i), len(chain))]
            for d in chain:
                assert torch.equal(kernels.attend(q[d : d + 1], k, v, start + d, None, D**-0.5), alone[d : d + 1])
    finally:
        torch.set_num_threads(threads)


def _rows(kind: str, T: int, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(T, V, generator=g)
    if kind == "ties":
        x = torch.randint(-3, 3, (T, V), generator=g).float()
    elif kind == "nan":
        x[:, 1::3] = float("nan")
    elif kind == "nan_last":  # only in the tail past the last 16-wide block (or the last lane of a full one)
        x[:, -1] = float("nan")
    elif kind == "all_neg_inf":
        x.fill_(float("-inf"))
    elif kind == "signed_zeros":
        x = torch.where(torch.rand(T, V, generator=g) < 0.5, -0.0, 0.0)
    elif kind == "two_infs":
        x[:, V // 2] = float("inf")
        x[:, -1] = float("inf")
    return x


@needs_kernels
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "nan_last", "all_neg_inf", "signed_zeros", "two_infs"])
@pytest.mark.parametrize("T,V", [(1, 1), (2, 5), (3, 16), (1, 17), (7, 49157), (64, 4096)])
def test_argmax_is_torchs_argmax_ties_nans_and_infinities_included(kind, T, V):
    x = _rows(kind, T, V, torch.Generator().manual_seed(T * V))
    assert torch.equal(ck.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ck.argmax_rows(x[:, : V // 2 + 1].t().contiguous().t()), x[:, : V // 2 + 1].argmax(dim=-1))


def test_argmax_rows_leaves_other_dtypes_to_torch(monkeypatch):
    x = torch.randn(3, 50, dtype=torch.float64)
    monkeypatch.setattr(ck, "cpu_kernels", lambda: pytest.fail("float64 must not reach the kernels"))
    assert torch.equal(ck.argmax_rows(x), x.argmax(dim=-1))


@needs_kernels
@pytest.mark.parametrize("T,V,k", [(1, 8, 8), (3, 17, 1), (2, 100, 8), (64, 4096, 8), (2, 49157, 8), (1, 300, 64)])
def test_topk_is_torchs_topk_on_distinct_values(T, V, k):
    x = torch.randn(T, V, generator=torch.Generator().manual_seed(V))
    assert torch.equal(ck.topk_rows(x, k), torch.topk(x, k, dim=-1).indices)


@needs_kernels
def test_topk_takes_equal_values_in_index_order_and_leaves_nan_rows_to_torch():
    x = torch.randint(-3, 3, (6, 1000), generator=torch.Generator().manual_seed(1)).float()
    ours = ck.topk_rows(x, 8)
    assert torch.equal(x.gather(1, ours), torch.topk(x, 8).values)
    for row, ids in zip(x, ours.tolist()):  # descending, equal values in index order, the lowest indices of the last
        assert ids == sorted(ids, key=lambda i: (-row[i].item(), i))
        last = [i for i in ids if row[i] == row[ids[-1]]]
        assert last == (row == row[ids[-1]]).nonzero().flatten().tolist()[: len(last)]
    x = torch.randn(2, 50)
    x[0, :45] = float("nan")  # 5 values that are not NaN, fewer than k: torch's answer (NaN counts as largest)
    assert torch.equal(ck.topk_rows(x, 8), torch.topk(x, 8).indices)
    x = torch.randn(3, 1003, generator=torch.Generator().manual_seed(2))
    x[:, ::7] = float("nan")  # enough other values: NaNs are skipped
    x[1, -1] = float("nan")
    assert torch.equal(ck.topk_rows(x, 8), torch.topk(x.nan_to_num(nan=float("-inf")), 8).indices)
