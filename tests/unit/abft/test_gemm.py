"""The one-GEMM check of attnchecker.abft.gemm: detection, location, repair and zero false
alarms, in every operand layout the backward uses (x or y transposed) and in fp32 / bf16 / fp16,
with its eager ops and with its Triton kernels (``check_impl="triton"``,
``attnchecker.kernels.gemm_check``, in Triton's interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnchecker import kernels
from attnchecker.abft.gemm import col_norms, gemm_check_, row_norms
from attnchecker.attention.impl import resolve
from attnchecker.attention.kernel_checks import gemm_check

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLS = pytest.mark.parametrize(
    "impl",
    ["eager", pytest.param("triton", marks=pytest.mark.skipif(
        not kernels.available(), reason="needs triton (CUDA or its interpreter)"))],
)  # fmt: skip


def _operands(M, K, N, dtype, seed, tx=False, ty=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, M, generator=g).t() if tx else torch.randn(M, K, generator=g)
    y = torch.randn(N, K, generator=g).t() if ty else torch.randn(K, N, generator=g)
    return (x * scale).to(dtype), (y / K**0.5).to(dtype)


def _check(out, x, y, max_rows=4, impl="eager", **kw):
    if impl == "triton":  # the registered ops (abft cannot import kernels: resolved outside)
        how = resolve("triton", out.device)
        assert how.kernels
        result = gemm_check(how, out, x, y, max_rows=max_rows, scale=1.0, **kw)
    else:
        result = gemm_check_(out, x, y, max_rows=max_rows, scale=1.0, **kw)
    rows, cols, value, lost, again = result
    return rows.item(), cols.item(), value.item(), bool(lost), bool(again)


@IMPLS
@settings(max_examples=40, deadline=None)
@given(
    M=st.integers(1, 64), K=st.integers(1, 96), N=st.integers(1, 64),
    dtype=st.sampled_from(DTYPES), tx=st.booleans(), ty=st.booleans(),
    seed=st.integers(0, 2**16), scale=st.sampled_from([1e-6, 1.0, 1e3]),
)  # fmt: skip
def test_no_false_alarm_on_clean_products(impl, M, K, N, dtype, tx, ty, seed, scale):
    x, y = _operands(M, K, N, dtype, seed, tx, ty, scale)
    out = x @ y
    before = out.clone()
    rows, cols, _, lost, again = _check(out, x, y, impl=impl)
    assert (rows, cols, lost, again) == (0, 0, False, False)
    assert torch.equal(out, before)  # nothing written on a clean product


@IMPLS
@settings(max_examples=40, deadline=None)
@given(
    M=st.integers(2, 48), K=st.integers(2, 64), N=st.integers(2, 48),
    dtype=st.sampled_from(DTYPES), tx=st.booleans(), ty=st.booleans(),
    seed=st.integers(0, 2**16), kind=st.sampled_from(["nan", "inf", "-inf", "large"]),
)  # fmt: skip
def test_one_extreme_element_is_found_and_repaired(impl, M, K, N, dtype, tx, ty, seed, kind):
    x, y = _operands(M, K, N, dtype, seed, tx, ty)
    clean = x @ y
    out = clone = clean.clone()
    g = torch.Generator().manual_seed(seed + 1)
    i, j = torch.randint(M, (1,), generator=g).item(), torch.randint(N, (1,), generator=g).item()
    bad = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}.get(kind)
    clone[i, j] = bad if bad is not None else 1e4 * (clean.abs().max().float().item() + 1)
    rows, _, value, lost, again = _check(out, x, y, impl=impl)
    assert rows >= 1 and not lost and not again
    # row i and column j (the element breaks both checks) recomputed from the operands, by
    # smaller GEMMs that may round differently; everything else as delivered
    assert torch.isfinite(out).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert torch.allclose(out.float(), clean.float(), rtol=tol, atol=tol)
    keep = torch.ones(M, N, dtype=torch.bool)
    keep[i], keep[:, j] = False, False
    assert torch.equal(out[keep], clean[keep])
    assert value != value or abs(value) > 0  # the delivered error is reported (NaN or its size)


@IMPLS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tx", "ty"), [(False, False), (True, False), (False, True)])
def test_a_whole_bad_column_is_repaired_and_a_second_one_is_lost(impl, dtype, tx, ty):
    x, y = _operands(40, 24, 16, dtype, 0, tx, ty)
    clean = x @ y
    for bad in (float("inf"), float("nan")):  # a NaN column ranks first and is taken too
        out = clean.clone()
        out[:, 5] = bad
        rows, cols, _, lost, again = _check(out, x, y, impl=impl)
        assert (rows, cols, lost, again) == (40, 1, False, False), bad
        assert torch.isfinite(out).all()
        assert torch.allclose(out.float(), clean.float(), rtol=1e-2, atol=1e-2)
    out = clean.clone()
    out[:, 5] = float("nan")
    out[:, 9] = float("nan")
    rows, cols, _, lost, again = _check(out, x, y, impl=impl)
    assert cols == 2
    if impl == "eager":  # one column repaired per check: the other stays, and is lost
        assert lost
        assert not again  # lost beyond the budget, not reproduced: the recomputed rows are clean
    else:  # the kernels repair every flagged row: both columns, no budget
        assert not lost and not again
        assert torch.allclose(out.float(), clean.float(), rtol=1e-2, atol=1e-2)


def test_every_row_within_the_budget_is_repaired():
    """Faults in three rows and three columns, four rows of budget: each row recomputed, none
    lost (a budget of one row leaves two)."""
    x, y = _operands(32, 16, 24, torch.float32, 5)
    clean = x @ y
    out = clean.clone()
    for i, j in ((3, 4), (11, 9), (20, 17)):
        out[i, j] = float("inf")
    rows, cols, _, lost, again = _check(out, x, y, max_rows=4)
    assert (rows, cols, lost, again) == (3, 3, False, False)
    assert torch.allclose(out, clean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_false_alarm_where_the_rounding_errors_add_up(dtype):
    """Constant operands: every output element rounds the same way, so a row's residual is as
    large as the rounding model allows and the Cauchy-Schwarz magnitude is tight (what random
    data never shows: a bound missing its sqrt(N) or the references' own rounding in half
    precision fails here). fp16 rows of large values: the references are fp32, a row sum of
    y overflows fp16's range."""
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        M, K, N = (int(v) for v in torch.randint(1, 200, (3,), generator=g))
        c, d = (float(v) for v in torch.rand(2, generator=g) + 0.5)
        x, y = torch.full((M, K), c).to(dtype), torch.full((K, N), d).to(dtype)
        out = x @ y
        assert _check(out, x, y)[:2] == (0, 0), (M, K, N, c, d)
    if dtype == torch.float16:
        x, y = torch.full((8, 16), 1e-3, dtype=dtype), torch.full((16, 128), 1e3, dtype=dtype)
        out = x @ y  # 16 each; a row of y sums to 128,000 > 65,504
        assert _check(out, x, y)[:2] == (0, 0)


@IMPLS
def test_an_operand_that_is_bad_itself_is_reproduced_not_repaired(impl):
    x, y = _operands(16, 8, 12, torch.float32, 3)
    x[2, 3] = float("inf")
    out = x @ y
    _, _, _, lost, again = _check(out, x, y, impl=impl)
    assert lost and again  # recomputing repeats it: the operands imply it


@pytest.mark.parametrize("t", [False, True])
def test_norms_in_either_layout(t):
    a = torch.randn(30, 50)
    x = a.t().contiguous().t() if t else a  # same values, the other layout
    assert torch.allclose(row_norms(x), torch.linalg.vector_norm(a, dim=1), rtol=1e-6)
    assert torch.allclose(col_norms(x), torch.linalg.vector_norm(a, dim=0), rtol=1e-6)
    assert (row_norms(torch.full((2, 4), 1e-30)) > 0).all()  # squares that underflow


@pytest.mark.skipif(not kernels.available(), reason="needs triton (CUDA or its interpreter)")
@settings(max_examples=30, deadline=None)
@given(
    M=st.integers(1, 80), K=st.integers(1, 130), N=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES), tx=st.booleans(), ty=st.booleans(),
    seed=st.integers(0, 2**16), faults=st.integers(0, 3), norms=st.booleans(),
)  # fmt: skip
def test_the_triton_kernels_give_the_eager_results(M, K, N, dtype, tx, ty, seed, faults, norms):
    """Same flags, counts and repairs from both implementations, with the operands' norms
    passed in (as a linear layer's backward shares them) or computed; up to three bad elements
    (within the eager region's budget of four rows: the kernels have none)."""
    x, y = _operands(M, K, N, dtype, seed, tx, ty)
    clean = x @ y
    g = torch.Generator().manual_seed(seed + 7)
    for _ in range(faults):
        i, j = (
            torch.randint(M, (1,), generator=g).item(),
            torch.randint(N, (1,), generator=g).item(),
        )
        clean[i, j] = float(("nan", "inf", "-inf", "1e30")[(i + j) % 4])
    kw = dict(x_rows=row_norms(x), y_cols=col_norms(y)) if norms else {}
    got = {}
    for impl in ("eager", "triton"):
        out = clean.clone()
        got[impl] = out, _check(out, x, y, impl=impl, **kw)
    (want_out, want), (out, res) = got["eager"], got["triton"]
    assert res[0:2] == want[0:2] and res[3:] == want[3:]  # rows, columns flagged; lost, again
    assert torch.equal(out.isfinite(), want_out.isfinite())
    fin = want_out.isfinite()
    assert torch.allclose(out[fin].float(), want_out[fin].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("v", [7e-20, 3e-20])
def test_no_false_alarm_where_the_products_underflow(v):
    """bf16 operands whose products (v^2, below fp32's smallest normal) a CPU bf16 GEMM flushes
    to zero: the delivered product is 0 while the references keep 256 of them per element; the
    underflow floor carries the ~2 inner products and sums lost behind each element (with one
    per element it alarms on every row and column)."""
    x = torch.full((16, 256), v).to(torch.bfloat16)
    y = torch.full((256, 32), v).to(torch.bfloat16)
    out = x @ y
    assert _check(out, x, y)[:2] == (0, 0)
