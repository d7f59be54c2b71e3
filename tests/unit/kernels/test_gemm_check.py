"""The GEMM check's registered ops (``attnchecker.kernels.gemm_check``, in Triton's interpreter
here): what the verify kernel computes is the tolerance model's excess (held equal to the torch
ops of ``reference``, whose constants come from ``abft.gemm.gemm_check_``), the record row is
written only on a flag, the repair touches nothing on a clean product, and a check is three
dispatched ops, none of them an aten op."""

from __future__ import annotations

import math

import pytest
import torch

from attnchecker import kernels
from attnchecker.abft.gemm import limits
from attnchecker.testing import OpCounter

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _gc():
    from attnchecker.kernels import gemm_check

    return gemm_check


def _case(M, K, N, dtype, seed, tx=False, ty=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(K, M, generator=g).t() if tx else torch.randn(M, K, generator=g)
    y = torch.randn(N, K, generator=g).t() if ty else torch.randn(K, N, generator=g)
    x, y = x.to(dtype), (y / K**0.5).to(dtype)
    floor, a, c, cap, *_ = limits(x @ y, x, y, 1.0)
    return x, y, {"floor": floor, "a": a, "c": c, "cap": cap}


def _record():
    return torch.zeros(7, dtype=torch.float64), torch.full((1,), 41.0, dtype=torch.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tx", "ty"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("given", [False, True])
def test_the_verify_kernel_computes_the_reference_excesses(dtype, tx, ty, given):
    gc = _gc()
    x, y, lim = _case(77, 130, 90, dtype, 3, tx, ty)
    out = x @ y
    out[5, 7] = 1e4  # one flagged row beside clean ones
    rows = torch.linalg.vector_norm(x.float(), dim=1) * 1.5 if given else None  # any norms
    want = gc.reference(out, x, y, x_rows=rows, **lim)
    rec, step = _record()
    refs = gc.gemm_refs(y)
    scr, bits = gc.gemm_verify(out, x, refs, rows, rec, step, y.numel(), lim["floor"], lim["a"],
                                lim["c"], lim["cap"])  # fmt: skip
    atol = 1e-5 * float(want["xn"].max())
    for i, name in enumerate(("ref", "res", "exc", "xn")):
        torch.testing.assert_close(scr[i], want[name], rtol=1e-5, atol=atol)
    assert torch.equal(~(scr[2] <= 0), ~(want["exc"] <= 0))  # the same rows flagged
    assert int(want["rows"]) == 1
    assert rec.tolist() == [1, 0, 0, 0, 0, 1, 41]  # count, detected, step: the repair does the rest
    assert (bits == 0).all()


def test_a_clean_product_writes_no_record_and_is_left_as_it_was():
    gc = _gc()
    for dtype in DTYPES:
        x, y, lim = _case(64, 96, 80, dtype, 5)
        out = x @ y
        before = out.clone()
        rec, step = _record()
        gc.check_(out, x, y, rec, step, **lim)
        assert torch.equal(out, before)
        assert (rec == 0).all(), rec


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_flag_is_located_repaired_and_recorded(dtype):
    """Three bad elements in two columns: three rows, two columns, the worst residual (NaN
    first), repaired; a bad operand row is reproduced and lost."""
    gc = _gc()
    x, y, lim = _case(70, 40, 50, dtype, 7)
    clean = x @ y
    out = clean.clone()
    out[3, 4], out[30, 4], out[60, 11] = float("inf"), 1e4, float("nan")
    rec, step = _record()
    gc.check_(out, x, y, rec, step, **lim)
    assert rec[[0, 1, 3, 4, 5, 6]].tolist() == [3, 2, 0, 0, 1, 41]
    assert math.isnan(rec[2])  # the NaN row ranks first
    torch.testing.assert_close(out.float(), clean.float(), rtol=2e-2, atol=2e-2)
    x[9, 2] = float("inf")
    out = x @ y
    rec, step = _record()
    gc.check_(out, x, y, rec, step, **lim)
    assert rec[0] >= 1 and rec[3] == 1 and rec[4] == 1  # lost, reproduced


def test_a_check_is_three_dispatched_ops_and_two_with_the_references_at_hand():
    gc = _gc()
    x, y, lim = _case(64, 48, 40, torch.float32, 1)
    out = x @ y
    refs = gc.gemm_refs(y)
    rec, step = _record()
    with OpCounter() as full:
        gc.check_(out, x, y, rec, step, **lim)
    with OpCounter() as cached:
        gc.check_(out, x, y, rec, step, refs=refs, **lim)
    ops = ("attnchecker.gemm_refs", "attnchecker.gemm_verify", "attnchecker.gemm_repair")
    assert dict(full.ops) == dict.fromkeys(ops, 1)
    assert dict(cached.ops) == dict.fromkeys(ops[1:], 1)
