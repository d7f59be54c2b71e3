"""The row and column check of one GEMM out (M, N) = x (M, K) @ y (K, N) as Triton kernels.

``check_impl="triton"``'s implementation of :func:`attnchecker.abft.gemm.gemm_check_`: the
same residuals, tolerances and repair, with each large tensor read by one pass of a
hand-written kernel instead of inductor's fusion of the region's ops (``"compiled"``, which
on CUDA also generates Triton). Three launches, ordered by their dependencies:

1. :func:`_rows_pass`, over blocks of rows: out's row sums (M,) and column sums (N,) in one pass
   over out, x's column sums 1^T x (K,) and its row norms (M,) in one pass over x, and
   ||x||_F^2 (the column sums and ||x||_F^2 accumulate across programs with atomic adds);
2. :func:`_cols_pass`, over blocks of columns, one pass over y: the column references
   (1^T x) y, y's row sums y 1 (K,), its column norms and ||y||_F^2, and each column's excess
   over its tolerance;
3. :func:`_rows_ref`, over blocks of rows, a second pass over x: the row references x (y 1)
   and each row's excess.

An excess is |residual| - floor + c ||operand row or column|| ||other operand||_F (c < 0, as
``gemm_check_`` computes it): > 0 or NaN where the check fails. All sums are fp32; the order of
atomic adds varies from run to run, which the worst-case bound of
:mod:`attnchecker.abft.tolerance` does not depend on. What follows the excesses (the worst
column and rows recomputed from the operands, fixed sizes, and the check after repair) is the
eager region's tail, :func:`attnchecker.abft.gemm.repair_`.

On a CPU the kernels run only in Triton's interpreter (tests); bf16 operands are read from fp32
copies there (the interpreter computes through numpy, which has no bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.gemm import repair_
from attnchecker.abft.tolerance import squares_lost
from attnchecker.kernels import interpreting

__all__ = ["excesses", "gemm_region"]

_BM, _BN, _BK = 32, 64, 64  # tile of a pass; a program loops over the other dimension
_F32 = torch.float32


@triton.jit
def _tile(P, r, c, s_r, s_c, rmask, cmask):
    """The (len(r), len(c)) tile of P at rows r and columns c (strides s_r, s_c) in fp32, 0
    outside the masks."""
    at = P + r[:, None] * s_r + c[None, :] * s_c
    return tl.load(at, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _span(start, n, BLOCK: tl.constexpr):
    """(start + 0 .. BLOCK - 1 as 64-bit offsets (BLOCK,), which of them are below n)."""
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    return offs, offs < n


@triton.jit
def _norms(GIVEN, offs, mask, sq, lost, FRO_AT, HAS_GIVEN: tl.constexpr):
    """The norms (len(offs),) of rows or columns: GIVEN's (precomputed by the caller), or the
    square roots of the sums of squares sq plus the rounding they lost; their squares are
    added to the Frobenius norm's square at FRO_AT."""
    if HAS_GIVEN:  # noqa: SIM108 (a static branch)
        norms = tl.load(GIVEN + offs, mask=mask, other=0.0)
    else:
        norms = tl.sqrt(sq) + lost
    tl.atomic_add(FRO_AT, tl.sum(tl.where(mask, norms * norms, 0.0), 0))
    return norms


@triton.jit
def _rows_pass(OUT, X, XROWS, RS, XN, XSUM, CSUM, FRO, M, N, K,
               so_m, so_n, sx_m, sx_k, lost_x,
               HAS_XROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr):  # fmt: skip
    rows, rmask = _span(tl.program_id(0).to(tl.int64) * BM, M, BM)  # (BM,)
    rs = tl.zeros([BM], dtype=tl.float32)
    for n0 in range(0, N, BN):
        cols, cmask = _span(n0, N, BN)
        t = _tile(OUT, rows, cols, so_m, so_n, rmask, cmask)
        rs += tl.sum(t, 1)
        tl.atomic_add(CSUM + cols, tl.sum(t, 0), mask=cmask)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask = _span(k0, K, BK)
        t = _tile(X, rows, ks, sx_m, sx_k, rmask, kmask)
        tl.atomic_add(XSUM + ks, tl.sum(t, 0), mask=kmask)
        if not HAS_XROWS:
            sq += tl.sum(t * t, 1)
    xn = _norms(XROWS, rows, rmask, sq, lost_x, FRO, HAS_XROWS)
    tl.store(RS + rows, rs, mask=rmask)
    tl.store(XN + rows, xn, mask=rmask)


@triton.jit
def _cols_pass(Y, YCOLS, XSUM, CSUM, Y1, FRO, EXC_C, N, K, sy_k, sy_n, lost_y, floor_c, c_c,
               HAS_YCOLS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    cols, cmask = _span(tl.program_id(0).to(tl.int64) * BN, N, BN)  # (BN,)
    ref = tl.zeros([BN], dtype=tl.float32)
    sq = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask = _span(k0, K, BK)
        t = _tile(Y, ks, cols, sy_k, sy_n, kmask, cmask)
        xs = tl.load(XSUM + ks, mask=kmask, other=0.0)
        ref += tl.sum(t * xs[:, None], 0)
        tl.atomic_add(Y1 + ks, tl.sum(t, 1), mask=kmask)
        if not HAS_YCOLS:
            sq += tl.sum(t * t, 0)
    yn = _norms(YCOLS, cols, cmask, sq, lost_y, FRO + 1, HAS_YCOLS)
    x_fro = tl.sqrt(tl.load(FRO))  # complete: the rows pass has finished
    res = tl.load(CSUM + cols, mask=cmask, other=0.0) - ref
    tl.store(EXC_C + cols, tl.abs(res) - floor_c + c_c * yn * x_fro, mask=cmask)


@triton.jit
def _rows_ref(X, Y1, RS, XN, FRO, REF, RES, EXC_R, M, K, sx_m, sx_k, floor_r, c_r,
              BM: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    rows, rmask = _span(tl.program_id(0).to(tl.int64) * BM, M, BM)  # (BM,)
    ref = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask = _span(k0, K, BK)
        t = _tile(X, rows, ks, sx_m, sx_k, rmask, kmask)
        y1 = tl.load(Y1 + ks, mask=kmask, other=0.0)
        ref += tl.sum(t * y1[None, :], 1)
    res = tl.load(RS + rows, mask=rmask, other=0.0) - ref
    y_fro = tl.sqrt(tl.load(FRO + 1))  # complete: the columns pass has finished
    xn = tl.load(XN + rows, mask=rmask, other=0.0)
    tl.store(REF + rows, ref, mask=rmask)
    tl.store(RES + rows, res, mask=rmask)
    tl.store(EXC_R + rows, tl.abs(res) - floor_r + c_r * xn * y_fro, mask=rmask)


def _readable(t: Tensor | None) -> Tensor | None:
    """t as the kernels read it: an fp32 copy of a bf16 tensor in the interpreter."""
    if t is not None and interpreting() and t.dtype == torch.bfloat16:
        return t.to(_F32)
    return t


def excesses(
    out: Tensor,
    x: Tensor,
    y: Tensor,
    x_rows: Tensor | None,
    y_cols: Tensor | None,
    floor_r: float,
    c_r: float,
    floor_c: float,
    c_c: float,
) -> tuple[Tensor, ...]:
    """The three passes: (xn (M,), y_fro (), ref_r (M,), res_r (M,), exc_r (M,), exc_c (N,)),
    fp32, as :func:`attnchecker.abft.gemm._gemm_region` computes them."""
    M, K = x.shape
    N = y.shape[1]
    dev = out.device
    o, xr, yr = _readable(out), _readable(x), _readable(y)
    acc = torch.zeros(2 * K + N + 2, device=dev, dtype=_F32)  # the atomic adds' accumulators
    xsum, csum, y1, fro = acc[:K], acc[K : K + N], acc[K + N : 2 * K + N], acc[2 * K + N :]
    rows = torch.empty(5, M, device=dev, dtype=_F32)  # row sums, norms, references, residuals,
    rs, xn, ref_r, res_r, exc_r = rows  # excesses
    exc_c = torch.empty(N, device=dev, dtype=_F32)
    # unit strides (the kernels index them so); xn is a placeholder pointer when absent
    xrows = x_rows.to(_F32).contiguous() if x_rows is not None else xn
    ycols = y_cols.to(_F32).contiguous() if y_cols is not None else exc_c
    grid_m, grid_n = (triton.cdiv(M, _BM),), (triton.cdiv(N, _BN),)
    _rows_pass[grid_m](o, xr, xrows, rs, xn, xsum, csum, fro, M, N, K, o.stride(0), o.stride(1),
                       xr.stride(0), xr.stride(1), squares_lost(K), HAS_XROWS=x_rows is not None,
                       BM=_BM, BN=_BN, BK=_BK)  # fmt: skip
    _cols_pass[grid_n](yr, ycols, xsum, csum, y1, fro, exc_c, N, K, yr.stride(0), yr.stride(1),
                       squares_lost(K), floor_c, c_c, HAS_YCOLS=y_cols is not None, BN=_BN,
                       BK=_BK)  # fmt: skip
    _rows_ref[grid_m](xr, y1, rs, xn, fro, ref_r, res_r, exc_r, M, K, xr.stride(0), xr.stride(1),
                      floor_r, c_r, BM=_BM, BK=_BK)  # fmt: skip
    return xn, fro[1].sqrt(), ref_r, res_r, exc_r, exc_c


def gemm_region(*args: object) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`attnchecker.abft.gemm._gemm_region` (the same arguments, the same results) with
    the excesses from the kernels."""
    out, x, y, x_rows, y_cols, _x_rm, y_cm, R, floor_r, c_r, floor_c, c_c = args
    xn, y_fro, ref_r, res_r, exc_r, exc_c = excesses(
        out, x, y, x_rows, y_cols, floor_r, c_r, floor_c, c_c
    )
    # x as it is: the kernels run on CUDA (or in the interpreter, tests)
    return repair_(out, x, x, y, y_cm, R, floor_r, c_r, xn, y_fro, ref_r, res_r, exc_r, exc_c)
