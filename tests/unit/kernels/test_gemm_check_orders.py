"""The GEMM checks' kernels give the same bytes whichever order their programs run in.

The GEMM check's and the projection check's ops (``attnchecker.kernels.gemm_check``,
``.projection_check``) each launch one wide grid of (row block, chunk) programs that write
partial sums; the last program of a block to arrive at its counter adds them in a fixed order;
the repairs claim columns in a bitmap and add exact integer counts to the records. Here, at
widths that give every launch several row blocks and several chunks, a check with injected
faults (bad elements of the product in several row blocks and column chunks, a NaN, a bad
operand row that is lost) is run with each launch's programs in order, reversed, in a GPU's
order and shuffled (:func:`attnchecker.kernels.launches.program_order`): every output, the
scratch, the column bitmap and the records must be byte for byte the in-order run's, and the
in-order run must locate, repair and record the faults.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton")

from attnchecker.kernels import available, interpreting
from attnchecker.kernels.launches import program_order

from .test_gemm_check import _case, _record

pytestmark = pytest.mark.skipif(
    not (available() and interpreting()), reason="program orders need the interpreter"
)

ORDERS = ("reversed", "gpu", "random")
SITES = (0, 0, 1, 1, 2, 2)  # six head groups counted by three sites


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        left, right = a[name].contiguous().view(torch.uint8), b[name].contiguous().view(torch.uint8)
        assert torch.equal(left, right), name  # byte for byte: NaN payloads, signed zeros


def _gemm(lost: bool) -> dict[str, torch.Tensor]:
    """A GEMM check's ops on out (100, 300) = x (100, 200) @ y (200, 300), faults injected."""
    from attnchecker.kernels import gemm_check as gc

    x, y, lim = _case(100, 200, 300, torch.float32, 11)
    if lost:
        x[70, 5] = float("inf")  # the operands imply the bad row: repaired as it was
    out = x @ y
    out[3, 4], out[40, 250], out[90, 20] = float("inf"), 1e4, float("nan")
    out[60, 100:164] += 1e3  # one row, a column tile
    rec, step = _record()
    refs = gc.gemm_refs(y)
    f, a, c, cap = lim["floor"], lim["a"], lim["c"], lim["cap"]
    scr, bits = gc.gemm_verify(out, x, refs, None, rec, step, y.numel(), f, a, c, cap)
    gc.gemm_repair(out, x, y, refs, scr, bits, rec, f, a, c, cap)
    return {"out": out, "refs": refs, "scr": scr, "bits": bits, "rec": rec}


def _projection(lost: bool) -> dict[str, torch.Tensor]:
    """A projection check's ops on y (70, 6 x 48) = x (70, 200) W^T + b, faults injected."""
    from attnchecker.kernels import projection_check as pc

    g = torch.Generator().manual_seed(13)
    T, K, N = 70, 200, 6 * 48
    x = torch.randn(T, K, generator=g)
    w, b = torch.randn(N, K, generator=g) / K**0.5, torch.randn(N, generator=g)
    if lost:
        x[50, 7] = float("inf")
    y = F.linear(x, w, b)
    y[3, 5], y[33, 150], y[66, 280] = float("nan"), 1e4, float("-inf")  # three sites
    y[10, 96:144] = 1e3  # a token, all of site 1's second group
    log, step = torch.zeros(3, 7, dtype=torch.float64), torch.full((1,), 9.0, dtype=torch.float64)
    ws = pc.proj_weights(w, b, len(SITES), False)
    site = list(SITES)
    scr, bits = pc.proj_verify(y, x, ws, site, 3, 1e-5, 1e-30, 1e-6, 8.0)
    pc.proj_repair(y, x, w, b, False, ws, site, scr, bits, log, step, [0, 1, 2], 1e-5, 1e-30,
                   1e-6, 8.0)  # fmt: skip
    return {"y": y, "ws": ws, "scr": scr, "bits": bits, "log": log}


def test_the_inputs_give_every_launch_several_row_blocks_and_chunks():
    """Else the orders would have nothing to reorder: each launch's grid at these widths."""
    from attnchecker.kernels.launches import recorded

    with recorded() as gemm:
        _gemm(False)
    with recorded() as proj:
        _projection(False)
    grids = {(n.kernel, n.grid) for n in (*gemm, *proj)}
    for kernel in ("refs_kernel", "verify_kernel", "repair_kernel"):
        assert all(min(g[0], g[1]) > 1 for k, g in grids if k == kernel), (kernel, grids)
    assert all(min(g) > 1 for k, g in grids if k == "weights_kernel"), grids
    # one launch an op: the partials' sums are the last arrivals', not a second kernel's
    assert [n.kernel for n in gemm] == ["refs_kernel", "verify_kernel", "repair_kernel"]
    assert [n.kernel for n in proj] == ["weights_kernel", "verify_kernel", "repair_kernel"]


@pytest.mark.parametrize("flagged", [False, True], ids=["clean", "flagged"])
def test_every_launch_leaves_the_arrival_counters_at_zero(flagged):
    """The next launch counts from 0 without a zeroing kernel: every counter a launch touched
    is reset by its last arrival, in any order, clean or flagged."""
    from attnchecker.kernels import gemm_check as gc
    from attnchecker.kernels import projection_check as pc

    def check(how=None):
        if flagged:
            _gemm(True), _projection(True)
            return
        x, y, lim = _case(100, 200, 300, torch.float32, 11)
        rec, step = _record()
        gc.check_(x @ y, x, y, rec, step, **lim)
        assert rec.tolist() == [0.0] * 7
        w = y.t().contiguous()
        log = torch.zeros(3, 7, dtype=torch.float64)
        ws = pc.proj_weights(w, None, 6, False)
        pc.check_(x @ y, x, w, None, False, ws, SITES, log, step, [0, 1, 2], factor=1e-5,
                  floor=1e-30, absf=1e-6, cap=8.0)  # fmt: skip
        assert not log.any()

    for how in (None, *ORDERS):
        with program_order(how) if how else contextlib.nullcontext():
            check()
        assert not gc.counters(torch.device("cpu"), 1).any(), how


@pytest.mark.parametrize(
    "lost",
    [pytest.param(False, marks=pytest.mark.slow, id="located"), pytest.param(True, id="lost")],
)
def test_a_flagged_gemm_check_is_the_same_in_every_program_order(lost):
    want = _gemm(lost)
    rec = want["rec"].tolist()
    assert rec[0] == 4 + lost and rec[5:] == [1, 41] and math.isnan(rec[2])  # rows, NaN first
    assert rec[1] == (300 if lost else 3 + 64)  # columns (the lost row's: all of them)
    assert rec[3:5] == ([1, 1] if lost else [0, 0])
    if not lost:
        x, y, _ = _case(100, 200, 300, torch.float32, 11)
        torch.testing.assert_close(want["out"], x @ y)
    for how in ORDERS:
        with program_order(how):
            _same(want, _gemm(lost))


@pytest.mark.parametrize(
    "lost",
    [pytest.param(False, marks=pytest.mark.slow, id="located"), pytest.param(True, id="lost")],
)
def test_a_flagged_projection_check_is_the_same_in_every_program_order(lost):
    want = _projection(lost)
    log = want["log"]
    assert log[:, 0].tolist() == [1 + lost, 2 + lost, 1 + lost]  # tokens flagged per site
    assert log[:, 2].isnan().all() and (log[:, 5:] == torch.tensor([1.0, 9.0])).all()
    assert (log[:, 3:5] == float(lost)).all()
    if not lost:
        assert log[:, 1].tolist() == [1, 1 + 48, 1]  # located columns
        assert torch.isfinite(want["y"]).all()
    for how in ORDERS:
        with program_order(how):
            _same(want, _projection(lost))
