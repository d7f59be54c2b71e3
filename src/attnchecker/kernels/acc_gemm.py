"""A GEMM that checks itself on its fp32 accumulator: out (M, N) = x (M, K) @ y (K, N) + b.

``check_impl="accumulator"`` (opt-in) computes the checked linear layers' GEMMs (forward y, dX,
dW) with this kernel instead of cuBLAS, so the check sees the products *before* they are rounded
to the output's dtype: a bf16 output row carries ~2^-9 of its L1 norm in rounding, which bounds
what any check of the delivered output can see (the rounding-tight bound of
:func:`attnchecker.abft.tolerance.gemm_terms`, ~0.01 of the row); the accumulator carries only the
fp32 accumulation's rounding, so the same row's check sees ~1e-4 of it
(:func:`~attnchecker.abft.tolerance.accumulator_terms`). AEGIS (OSDI'26) located its production
incidents this way; a check of bf16 outputs located none.

Two registered ops, two launches a GEMM:

1. ``attnchecker::acc_mm`` (:func:`mm_kernel`), the GEMM: (row block, column block) programs
   in grouped order (:data:`_GROUP` row blocks share their columns' tiles in L2), each a tile
   of tensor-core products accumulated in fp32. The epilogue adds the bias, writes the tile
   rounded to the output's dtype, and its rows' partial sums and L1 norms of the *accumulator*
   (with the bias) to PART[c]; the programs of column block 0 also compute, in the K loop, the
   rows' references x_m . (y 1) (``refs``: :func:`~attnchecker.kernels.gemm_check.gemm_refs` of
   y), their magnitude Q_m = sum_k |x_mk| |(y 1)_k| and ||x_m||^2, from the tiles of x they load
   anyway. The last program of a row block to arrive (:func:`~attnchecker.kernels.gemm_check.
   arrive`) adds its C partials in column order (no float atomics: every result is the same
   whichever order programs run in) and checks each row: flagged where

       |sum_n acc_mn - ref_m| > floor + f_sum A_m + f_ref Q_m + f_acc ||x_m|| ||y||_F

   (A_m the accumulator row's L1 norm). A flagged row block adds its count to the record and
   marks it detected at the clock's step; the clean path writes no record.
2. ``attnchecker::gemm_repair`` (:mod:`~attnchecker.kernels.gemm_check`'s, shared): on the
   device flag only, the flagged rows recomputed from the operands (with the bias), the bad
   columns located, the rows re-checked at the *delivered* output's bound (they are rounded
   outputs now; :func:`~attnchecker.abft.gemm.limits`).

What it cannot see: an error after the epilogue (the store, memory, a later kernel) leaves the
accumulator clean; the rows it writes are not re-read. Such an error is a corruption of the
next GEMM's input, which no checksum of that GEMM sees either (the checksums follow their
operands). The delivered-output check (``check_impl="triton"``) sees it at ~0.01 of its row.

Fault emulation (``delta``: an (M, N) fp32 tensor, a constexpr specialisation of its own, so
the clean kernel carries none of it): added to the accumulator before the epilogue, as a faulty
tensor core would leave it. :func:`reference` is the kernels' computation as torch ops, for the
tests that hold the two equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.gemm import limits
from attnchecker.abft.tolerance import accumulator_terms, squares_lost, underflow_floor
from attnchecker.kernels.gemm_check import (
    _fro,
    arrive,
    counters,
    counting,
    flag_rows,
    gemm_refs,
    gemm_repair,
)
from attnchecker.kernels.triton_utils import interpreting, readable, span, tile

__all__ = ["BLOCKS", "acc_mm", "blocks", "checked_mm", "mm_kernel", "reference", "terms",
           "threshold"]  # fmt: skip

_F32 = torch.float32
_GROUP = 8  # row blocks that walk their column blocks together (L2 reuse of y's tiles)

BLOCKS = {"gpu": (128, 128, 64, 8, 3), "gpu_fp32": (64, 64, 32, 4, 3),
          "interpreter": (64, 64, 64, 4, 1)}  # fmt: skip
"""(BM, BN, BK, warps, stages) of :func:`mm_kernel`: a GPU's for half-precision operands (a
tile of 128 x 128, Triton's matmul tutorial's Hopper configuration without autotuning: one
compilation a dtype), for fp32 operands in IEEE precision (half as wide: the 128 x 128 tile
spills on sm_80), and the interpreter's (fewer numpy calls per program at test sizes)."""


def blocks(dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """The tiles this process launches with for operands of ``dtype`` (:data:`BLOCKS`)."""
    from attnchecker.kernels.launches import as_on_gpu

    if interpreting() and not as_on_gpu():
        return BLOCKS["interpreter"]
    return BLOCKS["gpu_fp32" if dtype == torch.float32 else "gpu"]


@triton.jit
def mm_kernel(X, Y, B, OUT, REFS, DELTA, PART, SCR, BITS, REC, STEP, CNT, M, N, K, P, sx_m,
              sx_k, sy_k, sy_n, so_m, so_n, lost_x, lost_y, floor, f_sum, f_ref, f_acc,
              HAS_BIAS: tl.constexpr, HAS_DELTA: tl.constexpr, IEEE: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
              BP: tl.constexpr):  # fmt: skip
    """One (BM, BN) tile of out = x @ y + b and its rows' partial checksums (module
    docstring); the last program of a row block checks its rows (:func:`_check_rows`)."""
    pid = tl.program_id(0)
    R, C = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first = (pid // (GROUP * C)) * GROUP  # grouped order: GROUP row blocks a column sweep
    rows_in = tl.minimum(R - first, GROUP)
    r = (first + (pid % (GROUP * C)) % rows_in).to(tl.int64)
    c = ((pid % (GROUP * C)) // rows_in).to(tl.int64)
    rows, rmask = span(r * BM, M, BM)
    cols, cmask = span(c * BN, N, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    ref = tl.zeros([BM], dtype=tl.float32)  # column block 0 only: x_m . (y 1), Q_m, ||x_m||^2
    mag = tl.zeros([BM], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks, kmask = span(k0, K, BK)
        a = tile(X, rows, ks, sx_m, sx_k, rmask, kmask)
        b = tile(Y, ks, cols, sy_k, sy_n, kmask, cmask)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if c == 0:
            a32 = a.to(tl.float32)
            s = tl.load(REFS + ks, mask=kmask, other=0.0)
            ref += tl.sum(a32 * s[None, :], 1)
            mag += tl.sum(tl.abs(a32) * tl.abs(s)[None, :], 1)
            sq += tl.sum(a32 * a32, 1)
    both = rmask[:, None] & cmask[None, :]
    if HAS_DELTA:  # an emulated fault of the accumulator
        acc += tl.load(DELTA + rows[:, None] * N + cols[None, :], mask=both, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    at = OUT + rows[:, None] * so_m + cols[None, :] * so_n
    tl.store(at, acc.to(OUT.dtype.element_ty), mask=both)
    kept = tl.where(both, acc, 0.0)
    tl.store(PART + (c * 2 * M + rows), tl.sum(kept, 1), mask=rmask)
    tl.store(PART + (c * 2 * M + M + rows), tl.sum(tl.abs(kept), 1), mask=rmask)
    if c == 0:  # the references, for the row block's last program (SCR rows 0, 1, 3)
        tl.store(SCR + rows, ref, mask=rmask)
        tl.store(SCR + (rows + M), mag, mask=rmask)
        tl.store(SCR + (rows + 3 * M), sq, mask=rmask)
    if r == 0:  # the repair's column bitmap, zeroed
        tl.store(BITS + cols, tl.zeros([BN], dtype=tl.int32), mask=cmask)
    if arrive(CNT + r, C):
        _check_rows(B, PART, REFS, SCR, REC, STEP, rows, rmask, M, N, K, P, C, lost_x, lost_y,
                    floor, f_sum, f_ref, f_acc, HAS_BIAS, BM, BN, BP)  # fmt: skip


@triton.jit
def _check_rows(B, PART, REFS, SCR, REC, STEP, rows, rmask, M, N, K, P, C, lost_x, lost_y, floor,
                f_sum, f_ref, f_acc, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BP: tl.constexpr):  # fmt: skip
    """A row block's check from its C partials (added in column order): SCR (4, M) becomes
    (reference, residual, excess, ||x_m||) as :func:`~attnchecker.kernels.gemm_check.
    gemm_repair` reads it; a flagged row's count into the record."""
    rs = tl.zeros([BM], dtype=tl.float32)
    l1 = tl.zeros([BM], dtype=tl.float32)
    for j in range(0, C):
        at = PART + (j * 2 * M + rows)
        rs += tl.load(at, mask=rmask, other=0.0)
        l1 += tl.load(at + M, mask=rmask, other=0.0)
    ref = tl.load(SCR + rows, mask=rmask, other=0.0)
    mag = tl.load(SCR + (rows + M), mask=rmask, other=0.0)
    xn = tl.sqrt(tl.load(SCR + (rows + 3 * M), mask=rmask, other=0.0)) + lost_x
    if HAS_BIAS:  # sum(b) in fp64, rounded once; its rounding and the adds' into the floor
        bs = tl.zeros([BN], dtype=tl.float64)
        ba = tl.zeros([BN], dtype=tl.float64)
        for n0 in range(0, N, BN):
            ns, nmask = span(n0, N, BN)
            b = tl.load(B + ns, mask=nmask, other=0.0).to(tl.float64)
            bs += b
            ba += tl.abs(b)
        ref += tl.sum(bs, 0).to(tl.float32)
        floor += 2 * f_sum * tl.sum(ba, 0).to(tl.float32)
    res = rs - ref
    exc = tl.abs(res) - floor - f_sum * l1 - f_ref * mag - f_acc * xn * _fro(REFS, K, P, lost_y, BP)
    flag_rows(SCR, REC, STEP, rows, rmask, M, ref, res, exc, xn)


def terms(x: Tensor, y: Tensor, scale: float = 1.0) -> tuple[float, float, float, float]:
    """(floor, f_sum, f_ref, f_acc) of :func:`mm_kernel`'s check of x (M, K) @ y (K, N) at the
    tiles this process launches (:func:`~attnchecker.abft.tolerance.accumulator_terms`),
    ``scale`` times."""
    K, N = x.shape[1], y.shape[1]
    _, BN, BK, _, _ = blocks(x.dtype)
    f_sum, f_ref, f_acc = accumulator_terms(x.dtype, inner=K, length=N, block_n=BN, block_k=BK)
    return underflow_floor(_F32, length=N, inner=K), f_sum * scale, f_ref * scale, f_acc * scale


@torch.library.custom_op("attnchecker::acc_mm", mutates_args=("rec",))
def acc_mm(
    x: Tensor, y: Tensor, bias: Tensor | None, refs: Tensor, delta: Tensor | None, rec: Tensor,
    step: Tensor, floor: float, f_sum: float, f_ref: float, f_acc: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """out (M, N) = x (M, K) @ y (K, N) (+ ``bias`` (N,)) in their dtype, its rows checked on
    the accumulator against ``refs`` (:func:`~attnchecker.kernels.gemm_check.gemm_refs` of y)
    and flagged ones counted in ``rec`` (7,) float64 at the clock ``step``; ``delta``: (M, N)
    fp32 added to the accumulator (fault emulation). Returns (out, the scratch (4, M), the
    zeroed column bitmap (N,)) for :func:`~attnchecker.kernels.gemm_check.gemm_repair`. One
    launch. (A variant that wrote into a caller's ``new_empty`` output, a column range of a
    fused projection's, gave a compiled model a loss up to 1% off eager's, not diagnosed
    further: a fused projection's sites are concatenated instead.)"""
    (M, K), N = x.shape, y.shape[1]
    BM, BN, BK, warps, stages = blocks(x.dtype)
    R, C = triton.cdiv(M, BM), triton.cdiv(N, BN)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    scr = torch.empty(4, M, device=x.device, dtype=_F32)
    bits = torch.empty(N, device=x.device, dtype=torch.int32)
    part = torch.empty(C * 2 * M, device=x.device, dtype=_F32)
    o, xr, yr, br = readable(out), readable(x), readable(y), readable(bias)
    ieee = torch.float32 in (xr.dtype, yr.dtype) or xr.dtype != yr.dtype
    d = None if delta is None else delta.to(_F32).contiguous()
    cnt = counters(x.device, R)
    with counting(cnt):
        mm_kernel[(R * C,)](xr, yr, br, o, refs, d, part, scr, bits, rec, step, cnt, M, N, K,
                            refs.shape[0] - K, xr.stride(0), xr.stride(1), yr.stride(0),
                            yr.stride(1), o.stride(0), o.stride(1), squares_lost(K),
                            squares_lost(K * N), floor, f_sum, f_ref, f_acc,
                            HAS_BIAS=bias is not None, HAS_DELTA=delta is not None, IEEE=ieee,
                            BM=BM, BN=BN, BK=BK, GROUP=_GROUP, BP=64, num_warps=warps,
                            num_stages=stages)  # fmt: skip
    if o is not out:  # the interpreter's fp32 copy, rounded
        out.copy_(o)
    return out, scr, bits


@acc_mm.register_fake
def _(x, y, bias, refs, delta, rec, step, floor, f_sum, f_ref, f_acc):
    M, N = x.shape[0], y.shape[1]
    return (x.new_empty(M, N), x.new_empty(4, M, dtype=_F32),
            x.new_empty(N, dtype=torch.int32))  # fmt: skip


def checked_mm(
    x: Tensor, y: Tensor, bias: Tensor | None, rec: Tensor, step: Tensor, *,
    refs: Tensor | None = None, delta: Tensor | None = None, scale: float = 1.0,
) -> Tensor:  # fmt: skip
    """x @ y (+ ``bias``) checked on its accumulator and repaired (two ops, three without
    ``refs``, :func:`~attnchecker.kernels.gemm_check.gemm_refs` of y, at hand), the record
    added into the zeroed (7,) float64 row ``rec`` at the clock ``step``. x and y in the dtype
    the GEMM multiplies (both bf16 / fp16, or fp32 in IEEE precision), the output too."""
    if refs is None:
        refs = gemm_refs(y)
    floor, f_sum, f_ref, f_acc = terms(x, y, scale)
    out, scr, bits = acc_mm(x, y, bias, refs, delta, rec, step, floor, f_sum, f_ref, f_acc)
    proxy = out.new_empty(0)  # the delivered bound of a repaired (rounded) row
    lf, la, lc, lcap, *_ = limits(proxy, x, y, scale)
    gemm_repair(out, x, y, refs, scr, bits, rec, lf, la, lc, lcap, bias)
    return out


def reference(
    x: Tensor, y: Tensor, bias: Tensor | None = None, delta: Tensor | None = None, *,
    scale: float = 1.0,
) -> dict[str, Tensor]:  # fmt: skip
    """What :func:`mm_kernel` computes, with torch ops in fp32 / fp64 (for the tests): the
    accumulator, references, residuals, excesses and x's row norms (M,), the flagged rows."""
    x32, y32 = x.to(_F32), y.to(_F32)
    acc = x32 @ y32
    if delta is not None:
        acc = acc + delta.to(_F32)
    floor, f_sum, f_ref, f_acc = terms(x, y, scale)
    s = y.sum(1, dtype=torch.float64).to(_F32)  # (y 1), as gemm_refs rounds it
    ref, mag = x32 @ s, x32.abs() @ s.abs()
    if bias is not None:
        acc = acc + bias.to(_F32)
        ref = ref + bias.sum(dtype=torch.float64).to(_F32)
        floor = floor + 2 * f_sum * float(bias.abs().sum(dtype=torch.float64))
    xn = torch.linalg.vector_norm(x32, dim=1) + squares_lost(x.shape[1])
    fro = torch.linalg.vector_norm(y32) + squares_lost(y.numel())
    res = acc.sum(1) - ref
    exc = res.abs() - floor - f_sum * acc.abs().sum(1) - f_ref * mag - f_acc * xn * fro
    return {"acc": acc, "ref": ref, "res": res, "exc": exc, "xn": xn, "fro": fro,
            "flagged": ~(exc <= 0), "tol": exc.new_tensor(0) + (res.abs() - exc)}  # fmt: skip


def threshold(x: Tensor, y: Tensor, scale: float = 1.0) -> Tensor:
    """(M,) the smallest error of one accumulator element that :func:`mm_kernel` flags, per
    row, as a fraction of the row's L1 norm (its tolerance less its clean residual)."""
    r = reference(x, y, scale=scale)
    return (r["tol"] - r["res"].abs()).clamp_min(0) / r["acc"].abs().sum(1)

