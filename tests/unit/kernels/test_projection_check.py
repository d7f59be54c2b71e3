"""The projection check's registered ops (``attnchecker.kernels.projection_check``, in Triton's
interpreter here): the verify kernel computes the eager check's excess (held equal to the torch
ops of ``reference``), the weight sums' tail is the GEMM check's references of W (one pass
serves the forward check and the backward's dX check), a clean call writes nothing, a flag is
counted per site, located, repaired and recorded in the log rows given, and a check is two
dispatched ops."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from attnchecker import kernels
from attnchecker.abft.tolerance import CAP, gemm_terms
from attnchecker.attention.checks import Projection
from attnchecker.testing import OpCounter

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
T, K, G, n = 70, 48, 6, 16
N = G * n
SITES = (0, 0, 1, 1, 2, 2)  # three sites of two head groups each (a fused Q | K | V)


def _pc():
    from attnchecker.kernels import projection_check

    return projection_check


def _case(dtype, conv1d=False, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    weight = w.t().contiguous() if conv1d else w  # Conv1D stores (K, N)
    return x, weight, b, F.linear(x, w, b), _limits(dtype)


def _limits(dtype):
    """The row check's constants for outputs of ``dtype`` (as ``checks.row_limits``)."""
    f_abs, f_mag = gemm_terms(dtype, torch.device("cpu"), inner=K + 1, length=n)
    return {"factor": math.sqrt(n) * f_mag, "floor": 1e-30, "absf": f_abs,
            "cap": CAP * math.sqrt(n)}  # fmt: skip


def _run(y, x, weight, b, conv1d, lim, rows=(0, 1, 2)):
    pc = _pc()
    log = torch.zeros(3, 7, dtype=torch.float64)
    step = torch.full((1,), 9.0, dtype=torch.float64)
    # the weight sums of W and b as the GEMM multiplied them (kernel_checks.weight_sums)
    ws = pc.proj_weights(weight.to(y.dtype), None if b is None else b.to(y.dtype), G, conv1d)
    pc.check_(y, x, weight, b, conv1d, ws, SITES, log, step, list(rows), **lim)
    return log


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv1d", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_verify_kernel_computes_the_reference_excesses(dtype, conv1d, bias):
    pc = _pc()
    x, weight, b, y, lim = _case(dtype, conv1d, bias)
    y[4, 20] = 1e3  # a flagged (token, group) beside clean ones
    want = pc.reference(y, x, weight, b, conv1d, G, **lim)
    ws = pc.proj_weights(weight, b, G, conv1d)
    scr, _ = pc.proj_verify(y, x, ws, list(SITES), 3, lim["factor"], lim["floor"], lim["absf"],
                            lim["cap"])
    got = {"ref": scr[: T * G], "res": scr[T * G : 2 * T * G], "exc": scr[2 * T * G : 3 * T * G]}
    for name, v in got.items():
        torch.testing.assert_close(v.view(T, G), want[name], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(scr[3 * T * G : 3 * T * G + T], want["xn1"])
    flagged = ~(got["exc"].view(T, G) <= 0)
    assert torch.equal(flagged, ~(want["exc"] <= 0))
    assert flagged.sum() == 1 and flagged[4, 1]


@pytest.mark.parametrize("conv1d", [False, True])
def test_the_weight_sums_end_with_the_gemm_checks_references_of_w(conv1d):
    """The backward's dX check (dX = dY W) reads W's row sums and squares from the forward's
    weight sums: the same numbers as its own references pass over W would give."""
    from attnchecker.kernels.gemm_check import gemm_refs

    pc = _pc()
    _, weight, b, _, _ = _case(torch.float32, conv1d)
    ws = pc.proj_weights(weight, b, G, conv1d)
    w = weight.t() if conv1d else weight
    own = gemm_refs(w)
    tail = pc.refs_of(ws, N, K, G)
    torch.testing.assert_close(tail[:N], own[:N])
    torch.testing.assert_close(tail[N:].sum(), own[N:].sum())  # ||W||_F^2 in partial sums
    S = ws[: G * K].view(G, K)
    torch.testing.assert_close(S, w.reshape(G, n, K).sum(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_clean_call_writes_nothing(dtype):
    for conv1d in (False, True):
        x, weight, b, y, lim = _case(dtype, conv1d, seed=3)
        before = y.clone()
        log = _run(y, x, weight, b, conv1d, lim)
        assert torch.equal(y, before)
        assert (log == 0).all(), log


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conv1d", [False, True])
def test_faults_are_counted_per_site_located_and_repaired(dtype, conv1d):
    """An element of site 0, a whole row of site 1 and a whole column of site 2: the tokens
    and columns each site's record counts, the step, detected once, and the product rebuilt."""
    x, weight, b, clean, lim = _case(dtype, conv1d, seed=5)
    y = clean.clone()
    y[3, 5] = float("nan")  # site 0 (columns 0-31)
    y[10, 32:64] = 1e4  # site 1: one token, 32 columns
    y[:, 70] = float("inf")  # site 2: every token, one column
    log = _run(y, x, weight, b, conv1d, lim)
    assert log[:, 0].tolist() == [1, 1, T]  # flagged tokens
    assert log[:, 1].tolist() == [1, 32, 1]  # located columns
    assert log[:, 3:].tolist() == [[0, 0, 1, 9]] * 3  # not lost, not reproduced, detected, step
    assert log[:, 2].isnan().all()  # the worst residual, NaN first
    assert torch.isfinite(y).all()
    tol = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}[dtype]
    torch.testing.assert_close(y.float(), clean.float(), rtol=tol, atol=tol)


def test_a_bad_input_row_is_reproduced_and_lost_and_an_unchecked_site_writes_nothing():
    x, weight, b, _, lim = _case(torch.float32)
    x[7, 3] = float("inf")
    y = F.linear(x, weight, b)  # every output of token 7 INF or NaN: the operands imply it
    log = _run(y, x, weight, b, False, lim, rows=(0, -1, 2))  # site 1 not checked now
    assert log[0, [0, 3, 4, 5]].tolist() == [1, 1, 1, 1]
    assert log[2, [0, 3, 4, 5]].tolist() == [1, 1, 1, 1]
    assert (log[1] == 0).all()


def test_a_check_is_two_dispatched_ops_after_the_steps_weight_sums():
    pc = _pc()
    x, weight, b, y, lim = _case(torch.float32)
    ws = pc.proj_weights(weight, b, G, False)
    log, step = torch.zeros(3, 7, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    pc.check_(y, x, weight, b, False, ws, SITES, log, step, [0, 1, 2], **lim)  # warm-up
    with OpCounter() as c:  # then no op of its own, no tensor built from host data
        pc.check_(y, x, weight, b, False, ws, SITES, log, step, [0, 1, 2], **lim)
    assert dict(c.ops) == {"attnchecker.proj_verify": 1, "attnchecker.proj_repair": 1}


def test_each_head_group_is_counted_by_the_site_the_eager_check_counts_it_by():
    """Interleaved Q | K | V blocks (GPT-NeoX, Megatron's GQA), leading and trailing groups
    (timm's ParallelScalingBlock): the site of every group as the eager check orders them."""
    from attnchecker.attention.kernel_checks import sites_of

    w = torch.zeros(12, 4)
    neox = Projection(w, None, False, ("q", "k", "v"), 12, (4, 4, 4), interleaved=True)
    assert sites_of(neox) == (0, 1, 2) * 4
    gqa = Projection(w, None, False, ("q", "k", "v"), 12, (8, 2, 2), interleaved=True)
    assert sites_of(gqa) == (0, 0, 0, 0, 1, 2) * 2
    timm = Projection(w, None, False, ("q", "k", "v"), 12, (3, 3, 3), lead=2, trail=1)
    assert sites_of(timm) == (0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 0)
    assert sites_of(Projection(w, None, False, ("y",), 1)) == (0,)
    assert math.prod(len(sites_of(p)) == p.groups for p in (neox, gqa, timm))


@pytest.mark.parametrize("conv1d", [False, True])
def test_autocasts_mixed_operands_are_repaired_without_a_copy(conv1d):
    """Under bf16 autocast with fp32 weights (mixed precision training) x is bf16 and W fp32:
    the repair multiplies them in fp32 inside the kernel (no fp32 copy of x on every clean call,
    as there was: issue 54) and rebuilds the product autocast made, to bf16 rounding."""
    x, weight, b, _, lim = _case(torch.float32, conv1d, seed=3)
    x = x.to(torch.bfloat16)
    lim = _limits(torch.bfloat16)
    w = weight.t() if conv1d else weight
    with torch.autocast("cpu", dtype=torch.bfloat16):
        clean = F.linear(x, w, b)
    assert clean.dtype == torch.bfloat16
    y = clean.clone()
    y[6, 40] = float("inf")
    log = _run(y, x, weight, b, conv1d, lim)
    assert log[1, [0, 1, 3, 5]].tolist() == [1, 1, 0, 1]
    torch.testing.assert_close(y.float(), clean.float(), rtol=2e-2, atol=2e-2)
