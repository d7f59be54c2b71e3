"""The accumulator GEMM (``attnchecker.kernels.acc_gemm``, in Triton's interpreter here): its
output is the product, its check is the torch reference's (``acc_gemm.reference``), it flags
nothing clean over dtypes, layouts, signs and sizes, it sees an accumulator error of 1e-4 of
its row (the issue's target; a wider bound fails the threshold test), repairs what it flags in
place (bias included), and gives the same bytes whichever order its programs run in."""

from __future__ import annotations

import pytest
import torch

from attnchecker import kernels
from attnchecker.abft import tolerance

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ag():
    from attnchecker.kernels import acc_gemm

    return acc_gemm


def _case(M, K, N, dtype, seed, *, ty=False, bias=True, kind="randn"):
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        x = torch.randn(M, K, generator=g)
        y = torch.randn(N, K, generator=g).t() if ty else torch.randn(K, N, generator=g)
    else:  # same-sign data: partial sums grow monotonically (the deterministic terms)
        x = torch.rand(M, K, generator=g) + 0.5
        y = (torch.rand(N, K, generator=g).t() if ty else torch.rand(K, N, generator=g)) + 0.5
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x.to(dtype), (y / K**0.5).to(dtype), b


def _record():
    return torch.zeros(7, dtype=torch.float64), torch.full((1,), 13.0, dtype=torch.float64)


def _run(x, y, b, delta=None):
    ag = _ag()
    rec, step = _record()
    out = ag.checked_mm(x, y, b, rec, step, delta=delta)
    return out, rec


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ty", [False, True])
def test_the_output_is_the_product_and_the_check_is_the_references(dtype, ty):
    ag = _ag()
    x, y, b = _case(70, 130, 150, dtype, 1, ty=ty)
    rec, step = _record()
    refs = kernels_gemm_refs(y)
    floor, f_sum, f_ref, f_acc = ag.terms(x, y)
    out, scr, _bits = ag.acc_mm(x, y, b, refs, None, rec, step, floor, f_sum, f_ref, f_acc)
    r = ag.reference(x, y, b)
    # the accumulator rounded once (its fp32 sums in another order than torch's: an fp32
    # output differs in its last bits, a rounded one by at most one rounding)
    ulp = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), r["acc"].to(dtype).float(), rtol=ulp, atol=1e-6)
    torch.testing.assert_close(scr[0], r["ref"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scr[3], r["xn"], rtol=1e-5, atol=0)
    torch.testing.assert_close(scr[1], r["res"], rtol=0, atol=float(r["tol"].max()) / 4)
    assert rec.abs().sum() == 0  # clean: no record written


def kernels_gemm_refs(y):
    from attnchecker.kernels.gemm_check import gemm_refs

    return gemm_refs(y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("M", "K", "N", "kind", "bias"), [
    (1, 16, 8, "randn", False), (33, 700, 65, "randn", True), (130, 64, 300, "pos", True),
    (64, 1024, 64, "pos", False), (64, 1024, 64, "randn", True),
])  # fmt: skip
def test_no_false_alarm_on_clean_products(dtype, M, K, N, kind, bias):
    for seed in range(3):
        x, y, b = _case(M, K, N, dtype, seed, kind=kind, bias=bias)
        out, rec = _run(x, y, b)
        assert rec.abs().sum() == 0, (seed, rec)
        ref = x.float() @ y.float() + (0 if b is None else b.float())
        torch.testing.assert_close(out.float(), ref.to(dtype).float(), rtol=0.02, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_error_of_1e_4_of_its_row_is_seen(dtype):
    """The threshold: every row flags an accumulator error above 1e-4 of its L1 norm at base
    widths (K 768); the delivered-output check's bound flags ~0.01 (gemm_terms)."""
    ag = _ag()
    x, y, _ = _case(64, 768, 768, dtype, 5, bias=False)
    th = ag.threshold(x, y)
    assert float(th.max()) <= 1e-4, float(th.max())
    f_abs, _ = tolerance.gemm_terms(torch.bfloat16, torch.device("cpu"), inner=768, length=768)
    assert float(th.max()) < f_abs / 20  # far below what a check of bf16 outputs can see


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [2e-4, 1e-2, float("inf"), float("nan")])
def test_a_flagged_accumulator_error_is_repaired_in_place(dtype, size):
    ag = _ag()
    x, y, b = _case(90, 200, 140, dtype, 2)
    clean, _ = _run(x, y, b)
    r = ag.reference(x, y, b)
    delta = torch.zeros(90, 140)
    rows = (3, 70)  # two row blocks; different columns
    for i, (row, col) in enumerate(zip(rows, (5, 131), strict=True)):
        l1 = float(r["acc"][row].abs().sum())
        delta[row, col] = size * l1 * (-1) ** i if size == size else size
    out, rec = _run(x, y, b, delta)
    assert rec[0] == 2 and rec[5] == 1 and rec[6] == 13  # two rows flagged, at the step
    assert rec[1] == 2  # two columns located
    assert rec[3] == 0  # none lost
    assert torch.equal(out, clean)  # recomputed as the kernel computes (bias included)


def test_a_small_error_below_the_bound_passes_and_is_not_a_record():
    ag = _ag()
    x, y, b = _case(40, 64, 64, torch.bfloat16, 3)
    r = ag.reference(x, y, b)
    delta = torch.zeros(40, 64)
    delta[4, 9] = float(r["tol"][4] - r["res"][4].abs()) / 8  # under the tolerance
    _, rec = _run(x, y, b, delta)
    assert rec.abs().sum() == 0


@pytest.mark.skipif(not kernels.interpreting(), reason="program orders need the interpreter")
@pytest.mark.parametrize("order", ["reversed", "gpu", "random"])
def test_the_same_bytes_in_any_program_order(order):
    from attnchecker.kernels.launches import program_order

    x, y, b = _case(200, 96, 260, torch.bfloat16, 4)  # 4 row blocks x 5 column blocks
    delta = torch.zeros(200, 260)
    delta[7, 3], delta[150, 250], delta[199, 0] = 1.0, float("nan"), -3.0
    out0, rec0 = _run(x, y, b, delta)
    assert rec0[0] == 3
    with program_order(order):
        out1, rec1 = _run(x, y, b, delta)
    assert torch.equal(out0, out1)
    torch.testing.assert_close(rec1, rec0, rtol=0, atol=0, equal_nan=True)  # the NaN's value


def test_the_terms_follow_the_tiles_and_the_widths():
    f_sum, f_ref, f_acc = tolerance.accumulator_terms(torch.bfloat16, inner=4096, length=4096,
                                                      block_n=128, block_k=64)  # fmt: skip
    u = 2.0**-24
    assert f_sum == (7 + 32 + 1) * u and f_ref == (6 + 64 + 2) * u
    assert f_acc == tolerance.LAMBDA * 64 * 2 * u
    fp32 = tolerance.accumulator_terms(torch.float32, inner=4096, length=4096, block_n=128,
                                       block_k=64)[2]  # fmt: skip
    assert fp32 == tolerance.LAMBDA * 64 * 3 * u
