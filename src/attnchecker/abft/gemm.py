"""The check of one GEMM out = x @ y by rows and columns, and its repair, in few passes.

Rows: sum_n out_mn against x_m . (y 1); columns: sum_m out_mn against (1^T x) . y_n. The rounding
bound is :func:`~attnchecker.abft.tolerance.gemm_terms`'s rounding-tight one (issue 55): f_abs
times the delivered row's L1 norm (the outputs' own rounding) plus f_mag times a Cauchy-Schwarz
magnitude, ||x_m|| sqrt(N) ||y||_F for a row, ||y_:n|| sqrt(M) ||x||_F for a column (the
accumulation's). The references are exact enough for it: y's row sums (x's column sums)
accumulated in fp64, rounded once to fp32, and the matrix-vector product in fp32 from the
operands as the GEMM multiplied them (an operand wider than the output rounded to its dtype
first, as autocast rounds it). Up to ``max_rows`` worst rows and the worst column are
recomputed from the operands (fixed sizes: nothing synchronises), then every row is checked
again; what still fails is ``lost``.

Each tensor is read by as few passes as possible, each in the layout it is stored in, with the ops
measured fastest on a CPU (2 cores, AVX-512, torch 2.13, a (1024, 2304) fp32 operand): a
reduction along the contiguous dimension (``sum(1)``, ``vector_norm(dim=1)``: 0.14 / 0.25 ms) or
``sum(0)`` (0.19 ms), never ``vector_norm(dim=0)`` (2.7 ms; the sum of squares along dim 0 is
0.47 ms) nor a matrix-vector product with two columns (1.9 ms against 0.3 ms for one), and in
bf16 never a vector-matrix product (5.1 ms against 0.23 ms for a matrix-vector one). Callers that
check two GEMMs of one operand (a linear layer's dX = dY W and dW = dY^T X) pass its norms once.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnchecker.abft.cast import round_as
from attnchecker.abft.tolerance import (
    CAP,
    gemm_terms,
    norm_bound,
    squares_lost,
    underflow_floor,
)

__all__ = ["col_norms", "gemm_check_", "limits", "row_norms", "rows_excess"]

_F32 = torch.float32
_F64 = torch.float64


def row_norms(x: Tensor, rows_contiguous: bool | None = None) -> Tensor:
    """(M,) fp32 upper bounds on the row norms of x (M, K), one pass in x's own layout
    (:func:`~attnchecker.abft.tolerance.norm_bound`, with its underflow term).
    ``rows_contiguous``: x.stride(-1) == 1, when the caller knows it (see :func:`gemm_check_`)."""
    if rows_contiguous is None:
        rows_contiguous = x.stride(-1) == 1
    if rows_contiguous:
        return norm_bound(x, 1)
    # x = a.t() of a contiguous a: a column reduction of a (an op on the view x would write its
    # result in x's strides, 9x slower)
    af = x.t().to(_F32)
    return torch.mul(af, af).sum(0).sqrt_().add_(squares_lost(x.shape[1]))


def col_norms(x: Tensor) -> Tensor:
    """(K,) fp32 upper bounds on the column norms of x (M, K)."""
    return row_norms(x.t())


def _fp32(x: Tensor, rows_contiguous: bool) -> Tensor:
    """An fp32 copy of x in its own layout (``.to()`` of a transposed view is a strided copy,
    10 ms for (2304, 1024) on a CPU). Used on a CPU for half-precision operands: there a
    vector-matrix product in bf16 is 20x slower than a matrix-vector one, and a GEMM with a few
    rows 20-50x slower than in fp32 (40 ms for (8, 1024) x (1024, 2304)); both accumulate in
    fp32 alike, and repaired values are rounded to the output's dtype."""
    return x.to(_F32) if rows_contiguous else x.t().to(_F32).t()


def _cpu_half(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype != _F32


def _matvec(x: Tensor, v: Tensor) -> Tensor:
    """x (M, K) @ v (K,) in fp32, one pass over x (a half-precision x is exact in fp32)."""
    return x.to(_F32) @ v.to(_F32)


def _sums(t: Tensor, dim: int) -> Tensor:
    """t's sums along ``dim`` in fp32, accumulated in fp64: one rounding each (the references'
    u_32 m of :func:`~attnchecker.abft.tolerance.gemm_terms`)."""
    return t.sum(dim, dtype=_F64).to(_F32)


def _l1(t: Tensor, dim: int) -> Tensor:
    """The L1 norms of t along ``dim`` in fp32 (one pass, no |t| copy; INF is capped by the
    magnitude bound, :data:`~attnchecker.abft.tolerance.CAP`, NaN flags its row anyway)."""
    return torch.linalg.vector_norm(t, 1, dim=dim, dtype=_F32)


def as_multiplied(out: Tensor, *operands: Tensor, exact: bool = False) -> list[Tensor]:
    """The operands as the GEMM that gave ``out`` multiplied them: one wider than a half-precision
    output (an fp32 weight under autocast) rounded to the output's dtype, as autocast rounds it
    (``exact``: its values in fp32 by :func:`~attnchecker.abft.cast.round_as`, which a compiler
    cannot elide; else a copy in the output's dtype, for the registered ops)."""
    half = out.dtype in (torch.bfloat16, torch.float16)
    if exact:
        return [round_as(t, out.dtype) if half and t.dtype != out.dtype else t for t in operands]
    return [t.to(out.dtype) if half and t.dtype != out.dtype else t for t in operands]


def _column(y: Tensor, col: Tensor, cols_contiguous: bool) -> Tensor:
    """Column ``col`` (1,) of y (K, N) as a (K,) vector: ``index_select`` along dim 1 of a
    transposed y copies all of y first (9 ms for a (2304, 768) weight on a CPU)."""
    if cols_contiguous:
        return y.t().index_select(0, col).view(-1)
    return y.index_select(1, col).view(-1)


def gemm_check_(
    out: Tensor,
    x: Tensor,
    y: Tensor,
    *,
    max_rows: int,
    scale: float,
    x_rows: Tensor | None = None,
    y_cols: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Check and repair in place out (M, N) = x (M, K) @ y (K, N) (see the module docstring).

    ``x_rows`` (M,), ``y_cols`` (N,): :func:`row_norms` of x and :func:`col_norms` of y when the
    caller has them. Returns 0-dim float32 / bool tensors: flagged rows, flagged columns, the
    residual of the worst row, lost (a row fails after the repair), and reproduced (a
    recomputed row fails again: the operands imply it). The registered Triton ops of
    ``attnchecker.kernels.gemm_check`` check the same rows against the same :func:`limits`
    (rows only, every flagged row repaired, columns located on a flag)."""
    M = x.shape[0]
    x, y = as_multiplied(out, x, y, exact=True)
    lim = limits(out, x, y, scale)
    # the layouts too, read here: under torch.compile a layout query on a gradient inside
    # autocast(enabled=False) in a backward leaves autocast off for the rest of the traced
    # forward (torch 2.13), which made a compiled bf16 model multiply mixed dtypes
    layout = (x.stride(-1) == 1, y.stride(0) == 1)
    with torch.autocast(out.device.type, enabled=False), torch.no_grad():
        return _gemm_region(out, x, y, x_rows, y_cols, *layout, min(max_rows, M), *lim)


def limits(out: Tensor, x: Tensor, y: Tensor, scale: float):
    """(floor_r, a_r, c_r, cap_r, floor_c, a_c, c_c, cap_c): a row fails where |residual| -
    floor_r - a_r min(A_m, cap_r ||x_m|| ||y||_F) exceeds -c_r ||x_m|| ||y||_F (A_m: the row's L1
    norm; ||x_m|| sqrt(N) ||y||_F its magnitude bound), a column likewise (the constants that
    depend on sizes are arguments: a compiled region stays size-generic; the terms of
    :func:`~attnchecker.abft.tolerance.gemm_terms`, ``scale`` times, and its ``CAP``)."""
    M, K = x.shape
    N = y.shape[1]
    a_r, f_r = gemm_terms(out.dtype, out.device, inner=K, length=N)
    a_c, f_c = gemm_terms(out.dtype, out.device, inner=K, length=M)
    return (
        underflow_floor(out.dtype, length=N, inner=K), a_r * scale, -math.sqrt(N) * f_r * scale,
        CAP * math.sqrt(N),
        underflow_floor(out.dtype, length=M, inner=K), a_c * scale, -math.sqrt(M) * f_c * scale,
        CAP * math.sqrt(M),
    )  # fmt: skip


def rows_excess(out: Tensor, x: Tensor, y: Tensor, *, scale: float) -> Tensor:
    """(M,) each row's excess over its tolerance in :func:`gemm_check_` (> 0 or NaN: flagged),
    before any repair (for measurements: ``benchmarks/backward_sensitivity.py``)."""
    x, y = as_multiplied(out, x, y, exact=True)
    floor_r, a_r, c_r, cap_r, *_ = limits(out, x, y, scale)
    xn, y_fro = row_norms(x), torch.linalg.vector_norm(row_norms(y.t()))
    res = out.sum(1, dtype=_F32) - _matvec(x, _sums(y, 1))
    return _rows_excess(res, floor_r, a_r, _l1(out, 1), c_r, cap_r, xn, y_fro)


def _gemm_region(
    out: Tensor,
    x: Tensor,
    y: Tensor,
    x_rows: Tensor | None,
    y_cols: Tensor | None,
    x_rm: bool,
    y_cm: bool,
    R: int,
    floor_r: float,
    a_r: float,
    c_r: float,
    cap_r: float,
    floor_c: float,
    a_c: float,
    c_c: float,
    cap_c: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`gemm_check_`'s tensor work (:func:`limits`: a row fails where |residual| -
    floor_r - a_r min(A_m, cap_r ||x_m|| ||y||_F) exceeds -c_r ||x_m|| ||y||_F, a column
    likewise with ||y_:n|| ||x||_F; A: their L1 norms); ``x_rm``: x's rows are contiguous,
    ``y_cm``: y's columns are."""
    xn = row_norms(x, x_rm) if x_rows is None else x_rows  # (M,)
    yn = row_norms(y.t(), y_cm) if y_cols is None else y_cols  # (N,)
    x_fro, y_fro = torch.linalg.vector_norm(xn), torch.linalg.vector_norm(yn)
    # the operands of matrix-vector products: transposed half-precision ones in fp32 on a CPU
    xm = _fp32(x, x_rm) if x.dtype != _F32 else x  # read by two of them, in fp32
    ym = _fp32(y.t(), y_cm) if _cpu_half(y) and not y_cm else y.t()
    ref_c = _matvec(ym, _sums(x, 0))  # (N,)
    res_c = out.sum(0, dtype=_F32) - ref_c
    exc_c = _rows_excess(res_c, floor_c, a_c, _l1(out, 0), c_c, cap_c, yn, x_fro)
    ref_r = _matvec(xm, _sums(y, 1))  # (M,)
    res_r = out.sum(1, dtype=_F32) - ref_r
    exc_r = _rows_excess(res_r, floor_r, a_r, _l1(out, 1), c_r, cap_r, xn, y_fro)
    return repair_(out, x, xm, y, y_cm, R, floor_r, a_r, c_r, cap_r, xn, y_fro, ref_r, res_r,
                   exc_r, exc_c)  # fmt: skip


def _rows_excess(
    res: Tensor, floor: float, a: float, l1: Tensor, c: float, cap: float, xn: Tensor, fro
) -> Tensor:
    """(M,): > 0 or NaN where a row (or column) is flagged (``l1``: their L1 norms, capped at
    ``cap`` xn fro)."""
    mag = xn * fro
    l1 = torch.minimum(l1, mag * cap)
    return res.abs().sub_(floor).sub_(l1, alpha=a).add_(mag, alpha=c)


def repair_(
    out: Tensor,
    x: Tensor,
    xm: Tensor,
    y: Tensor,
    y_cm: bool,
    R: int,
    floor_r: float,
    a_r: float,
    c_r: float,
    cap_r: float,
    xn: Tensor,
    y_fro: Tensor,
    ref_r: Tensor,
    res_r: Tensor,
    exc_r: Tensor,
    exc_c: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The check's repair and its results from its excesses (computed by
    :func:`_gemm_region`'s ops or by the Triton kernels, ``attnchecker.kernels.gemm_check``).
    xm: x as the matrix-vector products read it (an fp32 copy of a transposed half-precision x
    on a CPU, else x); xn (M,): x's row norms; y_fro (): ||y||_F; ref_r, res_r, exc_r (M,): the
    rows' references, residuals and excesses; exc_c (N,): the columns' excesses; all fp32. The
    R worst rows (where flagged) and the worst column (where flagged) are recomputed from the
    operands, fixed sizes; then every row is checked again."""
    M = x.shape[0]
    worst, col = exc_c.max(0, keepdim=True)  # (1,) each; NaN ranks first
    new_col = _matvec(xm, _column(y, col, y_cm).to(x.dtype))  # (M,)
    top, idx = exc_r.topk(R)  # NaN ranks first
    take = ~(top <= 0)[:, None]  # (R, 1)
    yr = _fp32(y, not y_cm) if _cpu_half(y) else y
    fresh = (x.index_select(0, idx).to(yr.dtype) @ yr).to(out.dtype)  # (R, N)
    out.index_copy_(0, idx, torch.where(take, fresh, out.index_select(0, idx)))
    new_col = new_col.to(out.dtype).view(M, 1)
    out.index_copy_(1, col, torch.where(~(worst <= 0), new_col, out.index_select(1, col)))
    value = res_r.index_select(0, idx[:1]).view(())  # of the worst row (topk's first)
    res = out.sum(1, dtype=_F32) - ref_r
    still = ~(_rows_excess(res, floor_r, a_r, _l1(out, 1), c_r, cap_r, xn, y_fro) <= 0)
    again = (still.index_select(0, idx) & take.view(R)).any()
    rows = (~(exc_r <= 0)).sum(dtype=_F32)
    cols = (~(exc_c <= 0)).sum(dtype=_F32)
    return rows, cols, value, still.any(), again
