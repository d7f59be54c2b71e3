"""The check of one GEMM out (M, N) = x (M, K) @ y (K, N) in three registered ops.

``check_impl="triton"``'s implementation of :func:`attnchecker.abft.gemm.gemm_check_` on CUDA
(and in Triton's interpreter on a CPU, for the tests). Each op is one
``torch.library.custom_op``, so one call is one dispatched op (a CPU run counts launches as a GPU
launches them) and ``torch.compile`` keeps it opaque. Each op is one Triton launch over (row
block, chunk) programs that write partial sums; the last program of a row block to arrive (an
integer counter, :func:`arrive`) adds the row block's partials in a fixed order (chunk 0 first:
no float atomics, so every result and record is the same whichever order the programs run in).
The counters are one buffer a device (:func:`counters`) that every launch leaves at 0, so no
launch zeroes them first. The grids are sized to fill a GPU (at least twice its SMs where there
are blocks enough, :func:`chunks`) and to keep each program's share of the operands near
:data:`PROGRAM_BYTES`:

1. ``attnchecker::gemm_refs`` (:func:`refs_kernel`), the references' pass over y, where the
   caller has no cached one: y's row sums y 1 (K,), accumulated in fp64 and rounded once, and
   its Frobenius norm (a partial sum of
   squares per block of :data:`_BK` rows, summed by the verify);
2. ``attnchecker::gemm_verify`` (:func:`verify_kernel`), one pass over the rows of out and of
   x: each row's sum against its reference x_m . (y 1), and its excess over the tolerance
   |residual| - floor - a min(A_m, cap ||x_m|| ||y||_F) + c ||x_m|| ||y||_F (A_m the row's L1
   norm, summed in the same pass; c < 0; the constants are
   :func:`~attnchecker.abft.gemm.limits`', from :mod:`attnchecker.abft.tolerance`). A row
   block with a flagged row adds its count to the record row (an exact integer) and marks it
   detected at the clock's step (the clean path writes nothing but the per-row scratch and its
   row block's counter);
3. ``attnchecker::gemm_repair`` (:func:`repair_kernel`), predicated on the device flag (the
   record's flagged-row count, one load): every program returns at once when it is 0 (no
   counter touched). Else each flagged row is recomputed from the operands, a chunk of columns a
   program (every row of a whole-column fault: the whole product), its delivered
   and recomputed elements compared to locate the bad columns (an element further apart than
   twice its rounding bound; the count of distinct columns goes to the record), and checked
   again from its chunks' sums: a row that still fails is ``lost`` and ``reproduced`` (the
   operands imply it). Program (0, 0) writes the worst row's residual as the record's ``value``.

Unlike the eager region (:func:`attnchecker.abft.gemm._gemm_region`), which repairs at most
``max_rows`` rows and one column and checks columns too, this path detects by rows and repairs
every flagged row, with no budget (the repair runs only on a flag, so its size costs nothing on
a clean step); columns are located on a flag, not checked. Records are written straight into a
float64 row of :data:`~attnchecker.attention.records.RECORD_FIELDS` that the caller zeroed.

On a CPU the kernels run only in Triton's interpreter; bf16 operands are read from fp32 copies
there (it computes through numpy, which has no bf16). :func:`reference` computes what the
kernels compute with torch ops, for the tests that hold the two equal.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.tolerance import squares_lost
from attnchecker.kernels.triton_utils import (
    as_i64,
    block_product,
    readable,
    span,
    tile,
    worst_residual,
)

__all__ = ["PROGRAM_BYTES", "arrive", "check_", "chunks", "counters", "counting", "flag_rows",
           "gemm_refs", "gemm_repair", "gemm_verify", "reference", "width"]  # fmt: skip

_BM, _BN, _BK = 32, 64, 64  # a program's rows; the tiles it loops over
_F32 = torch.float32
_SMS = 132  # streaming multiprocessors of an H100 / H200
PROGRAM_BYTES = 1 << 20
"""The bytes of operands a program should stream at most (issue 54 allows 2 MB: one program
reaches tens of GB/s, so a launch of fewer, larger programs is serial)."""


def chunks(blocks: int, nbytes: int, most: int) -> int:
    """How many chunks to cut each of ``blocks`` row blocks' work into: enough for twice
    :data:`_SMS` programs and at most :data:`PROGRAM_BYTES` of the launch's ``nbytes`` a
    program, at most ``most`` (the chunks there are)."""
    want = max(2 * _SMS, triton.cdiv(nbytes, PROGRAM_BYTES))
    return max(1, min(most, triton.cdiv(want, max(blocks, 1))))


def width(n: int, parts: int, block: int) -> int:
    """The width of each of ``parts`` chunks of n: a multiple of ``block`` (no tile crosses two
    chunks); ``triton.cdiv(n, width)`` chunks are left."""
    return max(block, triton.cdiv(triton.cdiv(n, parts), block) * block)


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _programs(n: int, block: int) -> int:
    return max(1, triton.cdiv(n, block))


_COUNTERS: dict[torch.device, list[Tensor]] = {}


def counters(device: torch.device, n: int) -> Tensor:
    """At least ``n`` int32 arrival counters on ``device``, all 0 (:func:`arrive`). A launch
    that counts leaves every counter it touched at 0 again (the last arrival resets it), so one
    buffer a device serves every launch of the checks, which run one at a time on the step's
    stream, and no launch needs a zeroing kernel before it. Made once (grown by doubling; an
    outgrown one is kept: a captured CUDA graph may point at it)."""
    kept = _COUNTERS.setdefault(torch.device(device), [])
    if not kept or kept[-1].numel() < n:
        size = max(4096, triton.next_power_of_2(n))
        kept.append(torch.zeros(size, device=device, dtype=torch.int32))
    return kept[-1]


@contextlib.contextmanager
def counting(cnt: Tensor) -> Iterator[None]:
    """Around launches that count into ``cnt``: one that stops half way (an error in the
    interpreter) leaves it zeroed, not half counted."""
    try:
        yield
    except BaseException:
        cnt.zero_()
        raise


@triton.jit
def arrive(CNT, expected):
    """Count this program in at CNT; whether it is the last of ``expected`` (which then resets
    the counter to 0 for the next launch). The barrier before the release puts every thread's
    stores before it; the one after the acquire puts the other programs' stores before every
    thread's reads that follow."""
    tl.debug_barrier()
    last = tl.atomic_add(CNT, 1, sem="acq_rel") == expected - 1
    tl.debug_barrier()
    if last:
        tl.store(CNT, 0)
    return last


@triton.jit
def refs_kernel(Y, PART, REFS, CNT, K, N, NC, sy_k, sy_n, BK: tl.constexpr, BN: tl.constexpr):
    """Program (r, c), y's rows block r over its columns chunk c (NC wide): their sums
    PART[c, rows] (C, K), and their sum of squares PART[C K + c R + r]; the last of row block
    r's programs to arrive adds the C chunks' in their order: REFS[rows] = y 1 of the block,
    REFS[K + r] its sum of squares."""
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    R, C = tl.num_programs(0).to(tl.int64), tl.num_programs(1).to(tl.int64)
    rows, rmask = span(r * BK, K, BK)
    s = tl.zeros([BK], dtype=tl.float64)  # fp64: the references' sums rounded once
    sq = tl.zeros([BK], dtype=tl.float32)
    for n0 in range(0, NC, BN):
        cols, cmask = span(c * NC + n0, N, BN)
        t = tile(Y, rows, cols, sy_k, sy_n, rmask, cmask).to(tl.float64)
        s += tl.sum(t, 1)
        sq += tl.sum((t * t).to(tl.float32), 1)
    tl.store(PART + (c * K + rows), s, mask=rmask)
    tl.store(PART + (C * K + c * R + r), tl.sum(sq, 0).to(tl.float64))
    if arrive(CNT + r, C):
        s = tl.zeros([BK], dtype=tl.float64)
        total = tl.zeros([], dtype=tl.float64)
        for j in range(0, C):
            s += tl.load(PART + (j * K + rows), mask=rmask, other=0.0)
            total += tl.load(PART + (C * K + j * R + r))
        tl.store(REFS + rows, s.to(tl.float32), mask=rmask)
        tl.store(REFS + (K + r), total.to(tl.float32))


@triton.jit
def _fro(REFS, K, P, lost, BP: tl.constexpr):
    """||y||_F from the refs pass's P partial sums of squares (an upper bound: plus what the
    squares can lose to underflow, ``lost``)."""
    acc = tl.zeros([BP], dtype=tl.float32)
    for p0 in range(0, P, BP):
        ps, pmask = span(p0, P, BP)
        acc += tl.load(REFS + (ps + K), mask=pmask, other=0.0)
    return tl.sqrt(tl.sum(acc, 0)) + lost


@triton.jit
def verify_kernel(OUT, X, REFS, XN, PART, SCR, BITS, REC, STEP, CNT, M, N, K, P, NC, KC, so_m,
                  so_n, sx_m, sx_k, chunk, lost_x, lost_y, floor, atol, ctol, cap,
                  HAS_XN: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BP: tl.constexpr):  # fmt: skip
    """Program (r, c), rows block r over chunk c of out's columns (NC wide) and of x's (KC):
    the partial row sums, references, squares and L1 norms PART[c] (4, M); and the program's
    share of
    the column bitmap the repair marks, zeroed. The last of row block r's programs to arrive
    checks its rows (:func:`_verify_rows`)."""
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows, rmask = span(r * BM, M, BM)
    rs = tl.zeros([BM], dtype=tl.float32)
    l1 = tl.zeros([BM], dtype=tl.float32)
    for n0 in range(0, NC, BN):
        cols, cmask = span(c * NC + n0, N, BN)
        t = tile(OUT, rows, cols, so_m, so_n, rmask, cmask).to(tl.float32)
        rs += tl.sum(t, 1)
        l1 += tl.sum(tl.abs(t), 1)
    ref = tl.zeros([BM], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, KC, BK):
        ks, kmask = span(c * KC + k0, K, BK)
        t = tile(X, rows, ks, sx_m, sx_k, rmask, kmask).to(tl.float32)
        ref += tl.sum(t * tl.load(REFS + ks, mask=kmask, other=0.0)[None, :], 1)
        if not HAS_XN:
            sq += tl.sum(t * t, 1)
    at = PART + (c * 4 * M + rows)
    tl.store(at, rs, mask=rmask)
    tl.store(at + M, ref, mask=rmask)
    tl.store(at + 2 * M, sq, mask=rmask)
    tl.store(at + 3 * M, l1, mask=rmask)
    p = r * tl.num_programs(1) + c  # this program's chunk of the bitmap
    for j0 in range(0, chunk, BN):
        js, jmask = span(p * chunk + j0, N, BN)
        tl.store(BITS + js, tl.zeros([BN], dtype=tl.int32), mask=jmask & (js < (p + 1) * chunk))
    if arrive(CNT + r, tl.num_programs(1)):
        _verify_rows(PART, REFS, XN, SCR, REC, STEP, rows, rmask, M, K, P, tl.num_programs(1),
                     lost_x, lost_y, floor, atol, ctol, cap, HAS_XN, BM, BP)  # fmt: skip


@triton.jit
def _verify_rows(PART, REFS, XN, SCR, REC, STEP, rows, rmask, M, K, P, C, lost_x, lost_y, floor,
                 a, c, cap, HAS_XN: tl.constexpr, BM: tl.constexpr,
                 BP: tl.constexpr):  # fmt: skip
    """A rows block's check: its C chunks' partials added in order, each row's reference,
    residual, excess and x norm into SCR (4, M); a flagged row's count into the record."""
    rs = tl.zeros([BM], dtype=tl.float32)
    ref = tl.zeros([BM], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    l1 = tl.zeros([BM], dtype=tl.float32)
    for j in range(0, C):
        at = PART + (j * 4 * as_i64(M) + rows)
        rs += tl.load(at, mask=rmask, other=0.0)
        ref += tl.load(at + M, mask=rmask, other=0.0)
        sq += tl.load(at + 2 * M, mask=rmask, other=0.0)
        l1 += tl.load(at + 3 * M, mask=rmask, other=0.0)
    if HAS_XN:  # noqa: SIM108 (a static branch)
        xn = tl.load(XN + rows, mask=rmask, other=0.0)
    else:
        xn = tl.sqrt(sq) + lost_x
    res = rs - ref
    fro = _fro(REFS, K, P, lost_y, BP)
    l1 = tl.minimum(l1, cap * xn * fro)  # at most the magnitude bound (tolerance.CAP)
    exc = tl.abs(res) - floor - a * l1 + c * xn * fro
    flag_rows(SCR, REC, STEP, rows, rmask, M, ref, res, exc, xn)


@triton.jit
def flag_rows(SCR, REC, STEP, rows, rmask, M, ref, res, exc, xn):
    """A row block's check results into SCR (4, M) (reference, residual, excess, x's row norm:
    what :func:`repair_kernel` reads) and its flagged rows' count into the record, marked
    detected at the clock's step (nothing written to it on a clean block)."""
    tl.store(SCR + rows, ref, mask=rmask)
    tl.store(SCR + (rows + M), res, mask=rmask)
    tl.store(SCR + (rows + 2 * M), exc, mask=rmask)
    tl.store(SCR + (rows + 3 * M), xn, mask=rmask)
    flagged = tl.sum((~(exc <= 0.0) & rmask).to(tl.int32), 0)  # NaN compares False: flagged
    if flagged > 0:
        tl.atomic_add(REC, flagged.to(tl.float64))
        tl.store(REC + 5, 1.0)  # detected (every flagged program writes the same values)
        tl.store(REC + 6, tl.load(STEP))


@triton.jit
def repair_kernel(OUT, X, Y, B, REFS, SCR, BITS, REC, RSUM, CNT, M, N, K, P, NC, so_m, so_n,
                  sx_m, sx_k, sy_k, sy_n, lost_y, floor, f, atol, ctol, cap,
                  HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    """Program (r, c), on the flag: rows block r's flagged rows recomputed over columns chunk c
    (NC wide), bad columns located (each counted once: the bitmap), written, and their sums
    RSUM[c] (M,); the last of a flagged block's C programs to arrive re-checks its rows
    (:func:`_recheck_rows`). A clean program (a clean call, a block with no flagged row)
    counts nothing."""
    if tl.load(REC) > 0:  # the device flag: nothing below runs on a clean product
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        if (r == 0) & (c == 0):  # the worst row's residual (NaN ranks first) as the value
            tl.store(REC + 2, worst_residual(SCR, 2 * M, M, M, BM).to(tl.float64))
        rows, rmask = span(r * BM, M, BM)
        exc = tl.load(SCR + (rows + 2 * M), mask=rmask, other=0.0)
        bad = ~(exc <= 0.0) & rmask
        if tl.sum(bad.to(tl.int32), 0) > 0:
            xn = tl.load(SCR + (rows + 3 * M), mask=rmask, other=0.0)
            near = 2 * f * xn * _fro(REFS, K, P, lost_y, BP) + floor  # two roundings apart
            sums = tl.zeros([BM], dtype=tl.float32)
            l1 = tl.zeros([BM], dtype=tl.float32)
            for n0 in range(0, NC, BN):
                cols, cmask = span(c * NC + n0, N, BN)
                acc = block_product(X, Y, rows, bad, cols, cmask, K, sx_m, sx_k, sy_k, sy_n, IEEE,
                                    BM, BN, BK, 0, 0)  # fmt: skip
                if HAS_BIAS:  # (the accumulator GEMM's output: kernels.acc_gemm)
                    acc += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                new = acc.to(OUT.dtype.element_ty)
                at = OUT + rows[:, None] * so_m + cols[None, :] * so_n
                both = bad[:, None] & cmask[None, :]
                old = tl.load(at, mask=both, other=0.0).to(tl.float32)
                new32 = new.to(tl.float32)
                far = ~(tl.abs(old - new32) <= near[:, None] + 2 * atol * tl.abs(new32)) & both
                hit = tl.max(far.to(tl.int32), 0) > 0  # (BN,) columns this block locates
                was = tl.atomic_xchg(BITS + cols, tl.full([BN], 1, tl.int32), mask=hit)
                fresh = tl.sum((hit & (was == 0)).to(tl.int32), 0)
                if fresh > 0:
                    tl.atomic_add(REC + 1, fresh.to(tl.float64))
                tl.store(at, new, mask=both)
                sums += tl.sum(tl.where(both, new32, 0.0), 1)
                l1 += tl.sum(tl.where(both, tl.abs(new32), 0.0), 1)
            tl.store(RSUM + (c * 2 * M + rows), sums, mask=bad)
            tl.store(RSUM + (c * 2 * M + M + rows), l1, mask=bad)
            C = tl.num_programs(1)  # every chunk of a flagged block has work: C arrive
            if arrive(CNT + r, C):
                _recheck_rows(REFS, SCR, REC, RSUM, rows, rmask, bad, M, K, P, C, lost_y, floor,
                              atol, ctol, cap, BM, BP)  # fmt: skip


@triton.jit
def _recheck_rows(REFS, SCR, REC, RSUM, rows, rmask, bad, M, K, P, C, lost_y, floor, a, c, cap,
                  BM: tl.constexpr, BP: tl.constexpr):  # fmt: skip
    """A rows block's repaired rows (``bad``) checked again from their chunks' sums and L1
    norms (added in order); one that still fails is lost and reproduced."""
    sums = tl.zeros([BM], dtype=tl.float32)
    l1 = tl.zeros([BM], dtype=tl.float32)
    for j in range(0, C):
        sums += tl.load(RSUM + (j * 2 * as_i64(M) + rows), mask=bad, other=0.0)
        l1 += tl.load(RSUM + (j * 2 * as_i64(M) + M + rows), mask=bad, other=0.0)
    ref = tl.load(SCR + rows, mask=rmask, other=0.0)
    xn = tl.load(SCR + (rows + 3 * M), mask=rmask, other=0.0)
    y_fro = _fro(REFS, K, P, lost_y, BP)
    l1 = tl.minimum(l1, cap * xn * y_fro)
    again = ~(tl.abs(sums - ref) - floor - a * l1 + c * xn * y_fro <= 0.0) & bad
    if tl.sum(again.to(tl.int32), 0) > 0:
        tl.store(REC + 3, 1.0)  # lost
        tl.store(REC + 4, 1.0)  # reproduced: recomputing from the operands repeats it


@torch.library.custom_op("attnchecker::gemm_refs", mutates_args=())
def gemm_refs(y: Tensor) -> Tensor:
    """(K + P,) fp32: y's row sums y 1 (K,), then the P partial sums of squares of its blocks of
    rows (one launch: chunks' partials, summed by each row block's last)."""
    K, N = y.shape
    R = _programs(K, _BK)
    C = chunks(R, _nbytes(y), _programs(N, _BN))
    NC = width(N, C, _BN)
    C = _programs(N, NC)
    refs = torch.empty(K + R, device=y.device, dtype=_F32)
    part = torch.empty(C * (K + R), device=y.device, dtype=torch.float64)
    yr = readable(y)
    cnt = counters(y.device, R)
    with counting(cnt):
        refs_kernel[(R, C)](yr, part, refs, cnt, K, N, NC, yr.stride(0), yr.stride(1), BK=_BK,
                            BN=_BN)  # fmt: skip
    return refs


@gemm_refs.register_fake
def _(y: Tensor) -> Tensor:
    return y.new_empty(y.shape[0] + _programs(y.shape[0], _BK), dtype=_F32)


@torch.library.custom_op("attnchecker::gemm_verify", mutates_args=("rec",))
def gemm_verify(
    out: Tensor, x: Tensor, refs: Tensor, x_rows: Tensor | None, rec: Tensor, step: Tensor,
    n_y: int, floor: float, a: float, c: float, cap: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The rows' check of out (M, N) = x (M, K) @ y against ``refs`` (:func:`gemm_refs` of y,
    which has ``n_y`` elements); ``x_rows``: x's row norms when the caller has them. Adds to the
    record row ``rec`` (7,) float64; returns the scratch (4, M) fp32 (references, residuals,
    excesses, x's row norms) and the column bitmap (N,) int32, zeroed, for :func:`gemm_repair`.
    One launch: (row block, chunk) partials, added by each row block's last to arrive."""
    M, N = out.shape
    K = x.shape[1]
    R = _programs(M, _BM)
    C = chunks(R, _nbytes(out, x), max(_programs(N, _BN), _programs(K, _BK)))
    NC, KC = width(N, C, _BN), width(K, C, _BK)
    C = max(_programs(N, NC), _programs(K, KC))
    scr = torch.empty(4, M, device=out.device, dtype=_F32)
    bits = torch.empty(N, device=out.device, dtype=torch.int32)
    part = torch.empty(C * 4 * M, device=out.device, dtype=_F32)
    P = refs.shape[0] - K
    o, xr = readable(out), readable(x)
    xn = x_rows.to(_F32).contiguous() if x_rows is not None else scr
    cnt = counters(out.device, R)
    with counting(cnt):
        verify_kernel[(R, C)](o, xr, refs, xn, part, scr, bits, rec, step, cnt, M, N, K, P, NC,
                              KC, o.stride(0), o.stride(1), xr.stride(0), xr.stride(1),
                              triton.cdiv(N, R * C), squares_lost(K), squares_lost(n_y), floor,
                              a, c, cap, HAS_XN=x_rows is not None, BM=_BM, BN=_BN, BK=_BK,
                              BP=64)  # fmt: skip
    return scr, bits


@gemm_verify.register_fake
def _(out, x, refs, x_rows, rec, step, n_y, floor, a, c, cap):
    return out.new_empty(4, out.shape[0], dtype=_F32), out.new_empty(
        out.shape[1], dtype=torch.int32
    )


@torch.library.custom_op("attnchecker::gemm_repair", mutates_args=("out", "bits", "rec"))
def gemm_repair(
    out: Tensor, x: Tensor, y: Tensor, refs: Tensor, scr: Tensor, bits: Tensor, rec: Tensor,
    floor: float, a: float, c: float, cap: float, bias: Tensor | None = None,
) -> None:  # fmt: skip
    """Recompute, locate and re-check the rows :func:`gemm_verify` (or the accumulator GEMM,
    :mod:`~attnchecker.kernels.acc_gemm`, whose output adds ``bias``) flagged (none on a clean
    product: every program returns at once), into ``out`` and the record row ``rec``. One
    launch of (row block, column chunk) programs; a flagged block's last to arrive re-checks
    it."""
    M, N = out.shape
    K = x.shape[1]
    P = refs.shape[0] - K
    f = -c / math.sqrt(N)  # an element's rounding bound per ||x_m|| ||y||_F (c = -sqrt(N) f)
    o, xr, yr = readable(out), readable(x), readable(y)
    ieee = torch.float32 in (xr.dtype, yr.dtype)
    if xr.dtype != yr.dtype and not ieee:  # two half dtypes: tl.dot multiplies one (an fp32
        xr, yr = xr.to(_F32), yr.to(_F32)  # operand: the tiles go to fp32 in the kernel, so
        # no copy on every clean call, as there was: ~100 MB an o_proj at Llama-8B widths)
    bn = _BN // 2 if ieee else _BN  # fp32 tiles: half as wide, no spill
    R = _programs(M, _BM)
    NC = width(N, chunks(R, _nbytes(out, x, y), _programs(N, bn)), bn)
    C = _programs(N, NC)
    rsum = torch.empty(C * 2 * M, device=out.device, dtype=_F32)
    cnt = counters(out.device, R)
    with counting(cnt):
        repair_kernel[(R, C)](o, xr, yr, readable(bias), refs, scr, bits, rec, rsum, cnt, M, N,
                              K, P, NC,
                              o.stride(0), o.stride(1), xr.stride(0), xr.stride(1), yr.stride(0),
                              yr.stride(1), squares_lost(y.numel()), floor, f, a, c, cap,
                              HAS_BIAS=bias is not None, IEEE=ieee,
                              BM=_BM, BN=bn, BK=_BK, BP=64)  # fmt: skip
    if o is not out:  # the interpreter's fp32 copy
        out.copy_(o)


def check_(
    out: Tensor, x: Tensor, y: Tensor, rec: Tensor, step: Tensor, *, floor: float, a: float,
    c: float, cap: float, x_rows: Tensor | None = None, refs: Tensor | None = None,
) -> None:  # fmt: skip
    """Check and repair out = x @ y in place, adding to the zeroed record row ``rec`` (7,)
    float64 at the clock ``step`` (1,): the three ops, or two with ``refs`` (:func:`gemm_refs`
    of y) at hand. ``floor``, ``a`` and ``c``: a row's tolerance is
    floor + a min(A_m, cap ||x_m|| ||y||_F) - c ||x_m|| ||y||_F (A_m: its L1 norm;
    :func:`~attnchecker.abft.gemm.limits`)."""
    if refs is None:
        refs = gemm_refs(y)
    scr, bits = gemm_verify(out, x, refs, x_rows, rec, step, y.numel(), floor, a, c, cap)
    gemm_repair(out, x, y, refs, scr, bits, rec, floor, a, c, cap)


def reference(
    out: Tensor, x: Tensor, y: Tensor, *, floor: float, a: float, c: float, cap: float,
    x_rows: Tensor | None = None,
) -> dict[str, Tensor]:  # fmt: skip
    """What the kernels compute before the repair, with torch ops (for the tests): the
    references, residuals, excesses and row norms (M,), ||y||_F and the flagged-row count."""
    y32, x32 = y.to(_F32), x.to(_F32)
    fro = torch.linalg.vector_norm(y32) + squares_lost(y.numel())
    ref = x32 @ y.sum(1, dtype=torch.float64).to(_F32)
    res = out.to(_F32).sum(1) - ref
    l1 = out.to(_F32).abs().sum(1)
    xn = x_rows.to(_F32) if x_rows is not None else (
        torch.linalg.vector_norm(x32, dim=1) + squares_lost(x.shape[1]))  # fmt: skip
    l1 = torch.minimum(l1, cap * xn * fro)
    exc = res.abs() - floor - a * l1 + c * xn * fro
    return {"ref": ref, "res": res, "exc": exc, "xn": xn, "fro": fro,
            "rows": (~(exc <= 0)).sum()}  # fmt: skip
