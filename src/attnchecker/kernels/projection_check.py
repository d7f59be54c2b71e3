"""The forward check of one projection y (T, N) = x (T, K) W^T + b in three registered ops
(``check_impl="triton"``'s :func:`attnchecker.attention.checks.projection_check_`), each one
Triton launch: a wide pass of partial sums over a grid sized to fill a GPU
(:func:`attnchecker.kernels.gemm_check.chunks`), whose last program to arrive at a block's
counter adds the block's partials in a fixed order (:func:`~attnchecker.kernels.gemm_check.arrive`:
no float atomics, so every result and record is the same whichever order the programs run in;
the counters are the device's, left at 0 by every launch).

The N outputs are G head groups of n; a row is a (token, group) pair, checked against
x_t . (sum_{o in g} W_o) + sum_{o in g} b_o with the tolerance of the eager check (its
``factor``, ``floor``, ``absf`` and ``cap``, :func:`~attnchecker.attention.checks.row_limits`):
absf min(A_tg, cap M_tg) + factor M_tg, M_tg = (||x_t|| + 1) ||[W_g | b_g]||_F and A_tg the
group's L1 norm (the rounding-tight bound of :func:`~attnchecker.abft.tolerance.gemm_terms`).
W's sums are accumulated in fp64 (W as the GEMM multiplied it: autocast's bf16 copy, rounded by
the caller), x_t . S_g in fp32 from x as the GEMM multiplied it (:func:`rounded`), on the
tensor cores as a bf16 hi + lo split of S (~2^-17 of S kept).

1. ``attnchecker::proj_weights`` (:func:`weights_kernel` over (group, output chunk, K block)),
   one pass over W once per step (the caller caches it on the
   step clock: weights do not change between a forward and its backward, and fused optimizers
   do not bump version counters): per group, the sums of W over the group's outputs S (G, K), of
   b, of b's squares and of W's squares, and W's row sums W 1 (N,). The tail [W 1 | squares] is
   :func:`attnchecker.kernels.gemm_check.gemm_refs` of W, so the backward's dX check (dX = dY W)
   reuses it;
2. ``attnchecker::proj_verify`` (:func:`verify_kernel` over (row block, chunk of y's columns
   and of x's)), one pass over the rows of y and of x: each (token, group)'s sum, reference and
   excess (a row block's last program), and each site's count of flagged tokens (exact
   integers, counted on the device's counters and written out by the last row block; nothing
   written to the log on a clean call);
3. ``attnchecker::proj_repair`` (:func:`repair_kernel` over (row block, column chunk)),
   predicated on the flag (the sites' counts, one load): every program returns at once when
   they are 0 (no counter touched). Else every flagged token's row is recomputed from x, W and
   b, a column chunk a program, its elements compared with the delivered ones to locate bad
   columns (further apart than twice an element's rounding bound), and checked again from its
   chunks' sums by the block's last program: what still fails is lost and reproduced; program
   (0, 0) writes the detection into the log rows of the sites (flagged tokens, detected, step,
   the worst residual, NaN first).

The records go straight into the module's log (atomic adds of float64 rows of
:data:`~attnchecker.attention.records.RECORD_FIELDS`, the log rows of the sites given; -1: a
site the schedule does not check). Unlike the eager region, columns are located on a flag, not
range-checked, and every flagged token is repaired (no ``max_rows`` budget).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.tolerance import squares_lost
from attnchecker.kernels import interpreting
from attnchecker.kernels.constants import device_constant
from attnchecker.kernels.gemm_check import arrive, chunks, counters, counting, width
from attnchecker.kernels.triton_utils import (
    as_i64,
    block_product,
    readable,
    round_code,
    rounded,
    span,
    tile,
    worst_residual,
)

__all__ = ["check_", "norms", "proj_repair", "proj_verify", "proj_weights", "reference", "refs_of"]

_BM, _BN, _BK, _BO, _BR = 32, 64, 64, 32, 1024
_F32 = torch.float32


@triton.jit
def weights_kernel(W, B, PS, PW1, PSQ, OUT, CNT, N, K, G, n, OC, sw_o, sw_k, HAS_B: tl.constexpr,
                   ROUND: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
                   BR: tl.constexpr):  # fmt: skip
    """Program (g, j, c), group g's outputs chunk j (OC of them) over K block c: S's partial
    over the chunk PS[j, g, block] (J, G, K), the outputs' partial row sums PW1[c, outputs]
    (C, N) and the partial sum of squares PSQ[g, j, c]. Each sum's last program to arrive adds
    its partials in order into OUT ([S (G K) | b sums (G) | b squares (G) | W 1 (N) | W squares
    (G)]): S's block (g, c) the last of its J, W 1 of chunk (g, j) the last of its C, group g's
    squares and bias sums the last of its J C."""
    g, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    c = tl.program_id(2).to(tl.int64)
    J, C = tl.num_programs(1).to(tl.int64), tl.num_programs(2).to(tl.int64)
    ks, kmask = span(c * BK, K, BK)
    s = tl.zeros([BK], dtype=tl.float64)  # the sums in fp64, rounded once at the end
    sq = tl.zeros([BK], dtype=tl.float32)
    for o0 in range(0, OC, BO):
        os, omask = span(j * OC + o0, n, BO)
        t = rounded(tile(W, g * n + os, ks, sw_o, sw_k, omask, kmask).to(tl.float32), ROUND)
        s += tl.sum(t.to(tl.float64), 0)
        sq += tl.sum(t * t, 0)
        tl.store(PW1 + (c * N + g * n + os), tl.sum(t.to(tl.float64), 1), mask=omask)
    tl.store(PS + ((j * G + g) * K + ks), s, mask=kmask)
    tl.store(PSQ + ((g * J + j) * C + c), tl.sum(sq, 0))
    base = as_i64(G) * K
    if arrive(CNT + (g * C + c), J):  # S's block (g, c): its J chunks of outputs in order
        s = tl.zeros([BK], dtype=tl.float64)
        for q in range(0, J):
            s += tl.load(PS + ((q * G + g) * K + ks), mask=kmask, other=0.0)
        tl.store(OUT + (g * K + ks), s.to(tl.float32), mask=kmask)
    if arrive(CNT + (G * C + g * J + j), C):  # W 1 of chunk (g, j): its C K blocks in order
        for o0 in range(0, OC, BO):
            os, omask = span(j * OC + o0, n, BO)
            w1 = tl.zeros([BO], dtype=tl.float64)
            for q in range(0, C):
                w1 += tl.load(PW1 + (q * N + g * n + os), mask=omask, other=0.0)
            tl.store(OUT + (g * n + os + (base + 2 * G)), w1.to(tl.float32), mask=omask)
    if arrive(CNT + (G * C + G * J + g), J * C):  # group g's squares and bias
        wq = tl.zeros([BR], dtype=tl.float32)
        for q0 in range(0, J * C, BR):
            qs, qmask = span(q0, J * C, BR)
            wq += tl.load(PSQ + (g * J * C + qs), mask=qmask, other=0.0)
        tl.store(OUT + (g + (base + 2 * G + N)), tl.sum(wq, 0))
        bs = tl.zeros([BR], dtype=tl.float64)
        bq = tl.zeros([BR], dtype=tl.float32)
        if HAS_B:
            for o0 in range(0, n, BR):
                bo, bmask = span(o0, n, BR)
                b = rounded(tl.load(B + (g * n + bo), mask=bmask, other=0.0).to(tl.float32),
                            ROUND)  # fmt: skip
                bs += b.to(tl.float64)
                bq += b * b
        tl.store(OUT + (g + base), tl.sum(bs, 0).to(tl.float32))
        tl.store(OUT + (g + (base + G)), tl.sum(bq, 0))


@triton.jit
def _norms(WS, gs, gmask, G, K, N, lost_w, floor):
    """||[W_g | b_g]||_F of groups gs, an upper bound (plus what squares lose to underflow),
    plus the absolute ``floor``."""
    base = as_i64(G) * K
    wq = tl.load(WS + (gs + (base + 2 * G + N)), mask=gmask, other=0.0)
    bq = tl.load(WS + (gs + (base + G)), mask=gmask, other=0.0)
    return tl.sqrt(wq + bq) + lost_w + floor


@triton.jit
def _site_row(s: tl.constexpr, row0, row1, row2):
    if s == 0:
        return row0
    elif s == 1:
        return row1
    else:
        return row2


@triton.jit
def _flagged(SCR, T, G, S: tl.constexpr):
    """The sites' flagged-token counts (the repair's flag), one load."""
    ss = tl.arange(0, 4)
    return tl.sum(tl.load(SCR + (ss + (3 * as_i64(T) * G + T)), mask=ss < S, other=0.0), 0)


@triton.jit
def verify_kernel(Y, X, WS, SITE, PART, SCR, BITS, CNT, T, N, K, G, n, NC, KC, sy_t, sy_n, sx_t,
                  sx_k, chunk, lost_x, lost_w, factor, floor, absf, cap, S: tl.constexpr,
                  BF16: tl.constexpr, ROUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GP: tl.constexpr):  # fmt: skip
    """Program (r, c), tokens block r over chunk c of y's columns (NC wide) and x's (KC): the
    partial references x_t . S_g (x as the GEMM multiplied it: ``ROUND``, :func:`rounded`), group
    sums, group L1 norms and x's squares PART[c] ([ref | sums | L1] (T, G) | squares (T)); its
    share of the column bitmap zeroed. The last of block r's programs to
    arrive (counter CNT[r]) checks its tokens (:func:`_verify_rows`), counting each site's
    flagged tokens on CNT[R + 1 + s]; the last such block (counter CNT[R]) writes the counts
    into SCR and zeroes the sites' lost flags (for the repair), leaving the counters 0."""
    r, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rows, rmask = span(r * BM, T, BM)
    gs, gmask = span(0, G, GP)
    ref = tl.zeros([BM, GP], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, KC, BK):  # x_t . S_g for every group: one thin product
        ks, kmask = span(c * KC + k0, K, BK)
        t = tile(X, rows, ks, sx_t, sx_k, rmask, kmask)
        s = tile(WS, ks, gs, 1, K, kmask, gmask)  # S stored (G, K): read as (BK, GP)
        if BF16:  # S split hi + lo in bf16 (~2^-17 of S kept), products exact in fp32
            hi = rounded(s, 1)
            ref += tl.dot(t, hi.to(tl.bfloat16))
            ref += tl.dot(t, (s - hi).to(tl.bfloat16))
        else:
            ref += tl.dot(rounded(t.to(tl.float32), ROUND), s, input_precision="ieee")
        t = t.to(tl.float32)
        sq += tl.sum(t * t, 1)
    rs = tl.zeros([BM, GP], dtype=tl.float32)
    l1 = tl.zeros([BM, GP], dtype=tl.float32)
    for j0 in range(0, NC, BN):  # each group's sum of its outputs in the chunk
        start = c * NC + j0
        cols, cmask = span(start, N, BN)
        t = tile(Y, rows, cols, sy_t, sy_n, rmask, cmask).to(tl.float32)
        group = cols // n
        for g in range(start // n, (tl.minimum(start + BN, N) - 1) // n + 1):  # a tile's groups
            inside = (group == g)[None, :]
            acc = tl.sum(tl.where(inside, t, 0.0), 1)
            rs += tl.where(gs[None, :] == g, acc[:, None], 0.0)
            acc = tl.sum(tl.where(inside, tl.abs(t), 0.0), 1)
            l1 += tl.where(gs[None, :] == g, acc[:, None], 0.0)
    at = PART + (c * (3 * T * G + T) + rows[:, None] * G + gs[None, :])
    both = rmask[:, None] & gmask[None, :]
    tl.store(at, ref, mask=both)
    tl.store(at + T * G, rs, mask=both)
    tl.store(at + 2 * T * G, l1, mask=both)
    tl.store(PART + (c * (3 * T * G + T) + 3 * T * G + rows), sq, mask=rmask)
    R, C = tl.num_programs(0).to(tl.int64), tl.num_programs(1).to(tl.int64)
    p = r * C + c
    for j0 in range(0, chunk, BN):  # this program's chunk of the column bitmap
        js, jmask = span(p * chunk + j0, N, BN)
        tl.store(BITS + js, tl.zeros([BN], dtype=tl.int32), mask=jmask & (js < (p + 1) * chunk))
    if arrive(CNT + r, C):
        for h in range(0, BM, BM // 4):  # a quarter block at a time: fewer registers a thread
            part_rows, part_mask = span(r * BM + h, T, BM // 4)
            _verify_rows(WS, SITE, PART, SCR, CNT + (R + 1), part_rows, part_mask, T, N, K, G, C,
                         lost_x, lost_w, factor, floor, absf, cap, S, BM // 4, GP)  # fmt: skip
        if arrive(CNT + R, R):  # every block counted: the sites' counts out, lost flags zeroed
            ss = tl.arange(0, 4)
            counts = tl.atomic_xchg(CNT + (R + 1 + ss), tl.zeros([4], tl.int32), mask=ss < S)
            flags = SCR + (ss + (3 * as_i64(T) * G + T))
            tl.store(flags, counts.to(tl.float32), mask=ss < S)
            tl.store(flags + S, tl.zeros([4], tl.float32), mask=ss < S)


@triton.jit
def _verify_rows(WS, SITE, PART, SCR, SITES, rows, rmask, T, N, K, G, C, lost_x, lost_w, factor,
                 floor, absf, cap, S: tl.constexpr, BM: tl.constexpr,
                 GP: tl.constexpr):  # fmt: skip
    """A tokens block's check: its C chunks' partials added in order; references, residuals
    and excesses (T, G), ||x_t|| + 1 (T,) into SCR, and each site's flagged tokens added to its
    counter SITES[s]."""
    gs, gmask = span(0, G, GP)
    both = rmask[:, None] & gmask[None, :]
    at = rows[:, None] * G + gs[None, :]
    ref = tl.zeros([BM, GP], dtype=tl.float32)
    rs = tl.zeros([BM, GP], dtype=tl.float32)
    l1 = tl.zeros([BM, GP], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    for j in range(0, C):
        part = PART + j * (3 * as_i64(T) * G + T)
        ref += tl.load(part + at, mask=both, other=0.0)
        rs += tl.load(part + (at + T * G), mask=both, other=0.0)
        l1 += tl.load(part + (at + 2 * T * G), mask=both, other=0.0)
        sq += tl.load(part + (rows + 3 * T * G), mask=rmask, other=0.0)
    ref += tl.load(WS + (gs + as_i64(G) * K), mask=gmask, other=0.0)[None, :]
    xn1 = tl.sqrt(sq) + lost_x + 1.0
    res = rs - ref
    norms = _norms(WS, gs, gmask, G, K, N, lost_w, floor)
    mag = xn1[:, None] * norms[None, :]
    l1 = tl.minimum(l1, cap * mag)  # at most the magnitude bound (tolerance.CAP)
    exc = tl.abs(res) - absf * l1 - factor * mag
    tl.store(SCR + at, ref, mask=both)
    tl.store(SCR + (at + T * G), res, mask=both)
    tl.store(SCR + (at + 2 * T * G), exc, mask=both)
    tl.store(SCR + (rows + 3 * T * G), xn1, mask=rmask)
    flagged = ~(exc <= 0.0) & both  # NaN compares False: flagged
    site = tl.load(SITE + gs, mask=gmask, other=-1)
    for s in tl.static_range(S):  # tokens with a flagged group of site s
        hit = tl.sum(tl.max((flagged & (site[None, :] == s)).to(tl.int32), 1), 0)
        if hit > 0:
            tl.atomic_add(SITES + s, hit)


@triton.jit
def repair_kernel(Y, X, W, B, WS, SITE, SCR, BITS, LOG, STEP, RSUM, CNT, T, N, K, G, n, NC, sy_t,
                  sy_n, sx_t, sx_k, sw_o, sw_k, lost_w, factor, floor, absf, cap, near_f, row0,
                  row1, row2,
                  S: tl.constexpr, HAS_B: tl.constexpr, IEEE: tl.constexpr, RX: tl.constexpr,
                  RW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  BP: tl.constexpr, GP: tl.constexpr):  # fmt: skip
    """Program (r, c), on the flag: tokens block r's flagged tokens recomputed over columns
    chunk c (NC wide), bad columns located (each counted once: the bitmap) and written, and
    the chunk's group sums RSUM[c] (T, G); the last of a flagged block's C programs to arrive
    re-checks its tokens (:func:`_recheck_rows`). Program (0, 0) writes the detection
    (:func:`_record`). A clean program (a clean call, a block with no flagged token) counts
    nothing."""
    if _flagged(SCR, T, G, S) > 0:
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
        if (r == 0) & (c == 0):
            _record(SCR, LOG, STEP, T, G, row0, row1, row2, S, BP)
        rows, rmask = span(r * BM, T, BM)
        gs, gmask = span(0, G, GP)
        both = rmask[:, None] & gmask[None, :]
        exc = tl.load(SCR + (rows[:, None] * G + gs[None, :] + 2 * T * G), mask=both, other=0.0)
        bad = tl.max((~(exc <= 0.0) & both).to(tl.int32), 1) > 0  # (BM,) tokens to recompute
        if tl.sum(bad.to(tl.int32), 0) > 0:
            xn1 = tl.load(SCR + (rows + 3 * T * G), mask=rmask, other=0.0)
            sums = tl.zeros([BM, GP], dtype=tl.float32)
            l1 = tl.zeros([BM, GP], dtype=tl.float32)
            for n0 in range(0, NC, BN):
                cols, cmask = span(c * NC + n0, N, BN)
                # W^T's columns: W (N, K) read as (K, N) through its strides
                acc = block_product(X, W, rows, bad, cols, cmask, K, sx_t, sx_k, sw_k, sw_o, IEEE,
                                    BM, BN, BK, RX, RW)  # fmt: skip
                if HAS_B:
                    bias = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
                    acc += rounded(bias, RW)[None, :]
                new = acc.to(Y.dtype.element_ty)
                at = Y + rows[:, None] * sy_t + cols[None, :] * sy_n
                live = bad[:, None] & cmask[None, :]
                old = tl.load(at, mask=live, other=0.0).to(tl.float32)
                group = cols // n  # (BN,)
                # an element's rounding bound: the group's (||x_t|| + 1) ||[W_g | b_g]|| share
                cn = _norms(WS, group, cmask, G, K, N, lost_w, 0.0)
                new32 = new.to(tl.float32)
                near = 2 * (near_f * xn1[:, None] * cn[None, :] + absf * tl.abs(new32)) + floor
                far = ~(tl.abs(old - new32) <= near) & live
                hit = tl.max(far.to(tl.int32), 0) > 0
                was = tl.atomic_xchg(BITS + cols, tl.full([BN], 1, tl.int32), mask=hit)
                fresh = hit & (was == 0)
                col_site = tl.load(SITE + group, mask=cmask, other=-1)
                for s in tl.static_range(S):
                    row = _site_row(s, row0, row1, row2)
                    k = tl.sum((fresh & (col_site == s)).to(tl.int32), 0)
                    if (k > 0) & (row >= 0):
                        tl.atomic_add(LOG + row * 7 + 1, k.to(tl.float64))
                tl.store(at, new, mask=live)
                onehot = ((group[:, None] == gs[None, :]) & cmask[:, None]).to(tl.float32)
                sums += tl.dot(tl.where(live, new32, 0.0), onehot, input_precision="ieee")
                start = c * NC + n0  # the L1 norms a group at a time (a second dot spills)
                for g in range(start // n, (tl.minimum(start + BN, N) - 1) // n + 1):
                    acc1 = tl.sum(tl.where(live & (group == g)[None, :], tl.abs(new32), 0.0), 1)
                    l1 += tl.where(gs[None, :] == g, acc1[:, None], 0.0)
            at = RSUM + (c * 2 * T * G + rows[:, None] * G + gs[None, :])
            tl.store(at, sums, mask=both)  # 0 where not flagged: read only where flagged
            tl.store(at + T * G, l1, mask=both)
            C = tl.num_programs(1)  # every chunk of a flagged block has work: C arrive
            if arrive(CNT + r, C):
                for h in range(0, BM, BM // 4):  # a quarter block at a time: fewer registers
                    part_rows, part_mask = span(r * BM + h, T, BM // 4)
                    _recheck_rows(WS, SITE, SCR, LOG, RSUM, part_rows, part_mask, T, N, K, G, C,
                                  lost_w, factor, floor, absf, cap, row0, row1, row2, S, BM // 4,
                                  GP)  # fmt: skip


@triton.jit
def _recheck_rows(WS, SITE, SCR, LOG, RSUM, rows, rmask, T, N, K, G, C, lost_w, factor, floor,
                  absf, cap, row0, row1, row2, S: tl.constexpr, BM: tl.constexpr,
                  GP: tl.constexpr):  # fmt: skip
    """Tokens ``rows``' repaired rows (the flagged ones) checked again from their chunks' sums
    (added in order); a site with one that still fails is lost and reproduced, once a call (its
    lost flag)."""
    gs, gmask = span(0, G, GP)
    both = rmask[:, None] & gmask[None, :]
    at = rows[:, None] * G + gs[None, :]
    exc = tl.load(SCR + (at + 2 * T * G), mask=both, other=0.0)
    bad = tl.max((~(exc <= 0.0) & both).to(tl.int32), 1) > 0
    live = bad[:, None] & both
    sums = tl.zeros([BM, GP], dtype=tl.float32)
    l1 = tl.zeros([BM, GP], dtype=tl.float32)
    for j in range(0, C):
        sums += tl.load(RSUM + (j * 2 * as_i64(T) * G + at), mask=live, other=0.0)
        l1 += tl.load(RSUM + (j * 2 * as_i64(T) * G + T * G + at), mask=live, other=0.0)
    xn1 = tl.load(SCR + (rows + 3 * T * G), mask=rmask, other=0.0)
    norms = _norms(WS, gs, gmask, G, K, N, lost_w, 0.0)  # (GP,)
    ref = tl.load(SCR + at, mask=both, other=0.0)
    mag = xn1[:, None] * (norms + floor)[None, :]
    l1 = tl.minimum(l1, cap * mag)
    still = ~(tl.abs(sums - ref) - absf * l1 - factor * mag <= 0)
    still = still & live
    site = tl.load(SITE + gs, mask=gmask, other=-1)
    for s in tl.static_range(S):
        row = _site_row(s, row0, row1, row2)
        lost = tl.sum((still & (site[None, :] == s)).to(tl.int32), 1)
        if (tl.sum(lost, 0) > 0) & (row >= 0):
            one = tl.full([], 1.0, tl.float32)
            first = tl.atomic_add(SCR + (3 * as_i64(T) * G + T + S + s), one)
            if first == 0:  # once per site: lost, and reproduced (the operands imply it)
                tl.atomic_add(LOG + row * 7 + 3, 1.0)
                tl.atomic_add(LOG + row * 7 + 4, 1.0)


@triton.jit
def _record(SCR, LOG, STEP, T, G, row0, row1, row2, S: tl.constexpr, BP: tl.constexpr):
    """The detection into the sites' log rows (program (0, 0) of a flagged repair): flagged
    tokens, the worst residual (NaN first), detected once, the step."""
    value = worst_residual(SCR, 2 * T * G, T * G, T * G, BP)
    step = tl.load(STEP)
    for s in tl.static_range(S):
        row = _site_row(s, row0, row1, row2)
        count = tl.load(SCR + (3 * as_i64(T) * G + T + s))
        if (count > 0) & (row >= 0):
            at = LOG + row * 7
            tl.atomic_add(at, count.to(tl.float64))
            tl.atomic_add(at + 2, value.to(tl.float64))
            tl.atomic_add(at + 5, 1.0)
            tl.atomic_add(at + 6, step)


def _as_rows(weight: Tensor, conv1d: bool) -> Tensor:
    """The weight as (N, K) (a view: Conv1D stores it (K, N))."""
    return weight.t() if conv1d else weight


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@torch.library.custom_op("attnchecker::proj_weights", mutates_args=())
def proj_weights(
    weight: Tensor, bias: Tensor | None, groups: int, conv1d: bool, round_to: int = 0
) -> Tensor:
    """The packed weight-side sums of a projection of ``groups`` head groups (see
    :func:`weights_kernel`), fp32, of W and b rounded as the GEMM multiplies them
    (``round_to``: :func:`~attnchecker.kernels.triton_utils.round_code`; autocast's bf16 copy of
    fp32 weights, rounded in the kernel: no copy of W). One launch: partials over (group,
    output chunk, K block), each sum added in order by its last program to arrive."""
    w = readable(_as_rows(weight, conv1d))
    N, K = w.shape
    n = N // groups
    C = triton.cdiv(K, _BK) if K else 1
    OC = width(n, chunks(groups * C, _nbytes(weight), triton.cdiv(n, _BO)), _BO)
    J = triton.cdiv(n, OC) if n else 1
    out = torch.empty(groups * (K + 3) + N, device=w.device, dtype=_F32)
    ps = torch.empty(J * groups * K, device=w.device, dtype=torch.float64)
    pw1 = torch.empty(C * N, device=w.device, dtype=torch.float64)
    psq = torch.empty(groups * J * C, device=w.device, dtype=_F32)
    b = readable(bias)
    cnt = counters(w.device, groups * (C + J + 1))
    with counting(cnt):
        weights_kernel[(groups, J, C)](w, b if b is not None else out, ps, pw1, psq, out, cnt, N,
                                       K, groups, n, OC, w.stride(0), w.stride(1),
                                       HAS_B=bias is not None, ROUND=round_to, BO=_BO, BK=_BK,
                                       BR=_BR)  # fmt: skip
    return out


@proj_weights.register_fake
def _(weight, bias, groups, conv1d, round_to=0):
    N, K = _as_rows(weight, conv1d).shape
    return weight.new_empty(groups * (K + 3) + N, dtype=_F32)


def norms(ws: Tensor, N: int, K: int, groups: int, floor: float) -> Tensor:
    """(G,) ||[W_g | b_g]||_F + ``floor`` from :func:`proj_weights`'s output ``ws``, as the
    verify kernel computes them (torch ops: for the core's handoff, ``mode="passing"``)."""
    base = groups * K
    squares = ws[base + groups : base + 2 * groups] + ws[base + 2 * groups + N :]
    return squares.sqrt() + (_lost_w(N, K, groups) + floor)


def refs_of(ws: Tensor, N: int, K: int, groups: int) -> Tensor:
    """The tail of :func:`proj_weights`'s output that is ``gemm_refs`` of W (N, K)."""
    return ws[groups * (K + 2) :]


def _site_of(sites: tuple[int, ...], device: torch.device) -> Tensor:
    """(G,) int32 ``sites`` on ``device``, made once (a copy from host memory synchronises a
    CUDA stream); not kept when made under a fake mode (a shapes-only trace)."""
    return device_constant(
        ("sites", sites), device, lambda: torch.tensor(sites, dtype=torch.int32, device=device)
    )


def _gp(G: int) -> int:
    return max(16, triton.next_power_of_2(G))


def _scratch(T: int, G: int, n_sites: int) -> int:
    """proj_verify's scratch: [references | residuals | excesses] (T, G), ||x_t|| + 1 (T,), the
    sites' flagged-token counts (S,) and their lost flags (S,)."""
    return 3 * T * G + T + 2 * n_sites


@torch.library.custom_op("attnchecker::proj_verify", mutates_args=())
def proj_verify(
    y: Tensor, x: Tensor, ws: Tensor, sites: list[int], n_sites: int, factor: float, floor: float,
    absf: float, cap: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The rows' check of y (T, N) = x (T, K) W^T + b against ``ws`` (:func:`proj_weights`);
    ``sites`` (G ints): the site each group is counted by (a list, not a tensor: a compiled
    graph would build the tensor on every call; the op takes its device copy, made once).
    Returns the scratch (references, residuals and excesses (T, G), ||x_t|| + 1 (T,), each
    site's flagged tokens, the sites' lost flags, zeroed) and the column bitmap (N,) int32,
    zeroed, for :func:`proj_repair`. One
    launch: (token block, chunk) partials, added by each token block's last to arrive."""
    T, N = y.shape
    K = x.shape[1]
    G = len(sites)
    site = _site_of(tuple(sites), y.device)
    R = triton.cdiv(T, _BM) if T else 1
    C = chunks(R, _nbytes(y, x), max(triton.cdiv(N, _BN), triton.cdiv(K, _BK)))
    NC, KC = width(N, C, _BN), width(K, C, _BK)
    C = max(triton.cdiv(N, NC), triton.cdiv(K, KC))
    scr = torch.empty(_scratch(T, G, n_sites), device=y.device, dtype=_F32)
    bits = torch.empty(N, device=y.device, dtype=torch.int32)
    part = torch.empty(C * (3 * T * G + T), device=y.device, dtype=_F32)
    yr, xr = readable(y), readable(x)
    cnt = counters(y.device, R + 1 + n_sites)  # R blocks', the blocks', the sites' counts
    with counting(cnt):
        verify_kernel[(R, C)](yr, xr, ws, site, part, scr, bits, cnt, T, N, K, G, N // G, NC,
                              KC, yr.stride(0), yr.stride(1), xr.stride(0), xr.stride(1),
                              triton.cdiv(N, R * C), squares_lost(K), _lost_w(N, K, G), factor,
                              floor, absf, cap, S=n_sites, BF16=xr.dtype == torch.bfloat16,
                              ROUND=round_code(x.dtype, y.dtype), BM=_BM, BN=_BN, BK=_BK,
                              GP=_gp(G))  # fmt: skip
    return scr, bits


@proj_verify.register_fake
def _(y, x, ws, sites, n_sites, factor, floor, absf, cap):
    T, N = y.shape
    return (y.new_empty(_scratch(T, len(sites), n_sites), dtype=_F32),
            y.new_empty(N, dtype=torch.int32))  # fmt: skip


def _lost_w(N: int, K: int, G: int) -> float:
    """What a group's squares can lose to underflow: its n outputs' norms over K (the eager
    check's per-output bound) and their norm over n."""
    n = N // G
    return math.sqrt(n) * squares_lost(K) + squares_lost(n)


@torch.library.custom_op("attnchecker::proj_repair", mutates_args=("y", "scr", "bits", "log"))
def proj_repair(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, ws: Tensor,
    sites: list[int], scr: Tensor, bits: Tensor, log: Tensor, step: Tensor, rows: list[int],
    factor: float, floor: float, absf: float, cap: float,
) -> None:  # fmt: skip
    """Record, recompute, locate and re-check what :func:`proj_verify` flagged (nothing on a
    clean call: every program returns at once), into y and the log rows ``rows`` of the sites.
    One launch of (token block, column chunk) programs; a flagged block's last to arrive
    re-checks it."""
    T, N = y.shape
    K = x.shape[1]
    G, S = len(sites), len(rows)
    site = _site_of(tuple(sites), y.device)
    R = triton.cdiv(T, _BM) if T else 1
    yr, xr, b = readable(y), readable(x), readable(bias)
    w = readable(_as_rows(weight, conv1d))
    ieee = torch.float32 in (xr.dtype, w.dtype)
    if xr.dtype != w.dtype and not ieee:  # two half dtypes: tl.dot multiplies one (with an
        xr, w = xr.to(_F32), w.to(_F32)  # fp32 operand the kernel takes its tiles to fp32:
        # no copy of x on every clean call, as there was under autocast with fp32 weights)
    bn = _BN // 2 if ieee else _BN  # fp32 tiles: half as wide, no spill
    NC = width(N, chunks(R, _nbytes(y, x, weight), triton.cdiv(N, bn)), bn)
    C = triton.cdiv(N, NC) if N else 1
    rsum = torch.empty(C * 2 * T * G, device=y.device, dtype=_F32)
    r = [*rows, -1, -1][:3]
    cnt = counters(y.device, R)
    with counting(cnt):
        repair_kernel[(R, C)](yr, xr, w, b if b is not None else ws, ws, site, scr, bits, log,
                              step, rsum, cnt, T, N, K, G, N // G, NC, yr.stride(0),
                              yr.stride(1), xr.stride(0), xr.stride(1), w.stride(0), w.stride(1),
                              _lost_w(N, K, G), factor, floor, absf, cap,
                              factor / math.sqrt(N // G),
                              *r,
                              S=S, HAS_B=bias is not None, IEEE=ieee,
                              RX=round_code(x.dtype, y.dtype),
                              RW=round_code(weight.dtype, y.dtype), BM=_BM, BN=bn, BK=_BK,
                              BP=64, GP=_gp(G))  # fmt: skip
    if yr is not y:  # the interpreter's fp32 copy
        y.copy_(yr)


def check_(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, ws: Tensor,
    sites: tuple[int, ...], log: Tensor, step: Tensor, rows: list[int], *, factor: float,
    floor: float, absf: float, cap: float,
) -> Tensor:  # fmt: skip
    """Check and repair y (T, N) = x (T, K) W^T + b in place, into the log rows ``rows`` of its
    sites (``sites``: the site of each head group, indices into ``rows``); returns the scratch
    (the references (T, G) first; :func:`proj_verify`)."""
    scr, bits = proj_verify(y, x, ws, list(sites), len(rows), factor, floor, absf, cap)
    proj_repair(y, x, weight, bias, conv1d, ws, list(sites), scr, bits, log, step, rows, factor,
                floor, absf, cap)  # fmt: skip
    return scr


def reference(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, groups: int, *,
    factor: float, floor: float, absf: float, cap: float,
) -> dict[str, Tensor]:  # fmt: skip
    """What the verify kernel computes, with torch ops (for the tests): references, residuals
    and excesses (T, G), ||x_t|| + 1 (T,). ``weight``, ``bias``: as the GEMM multiplied them."""
    w = _as_rows(weight, conv1d).to(_F32)
    N, K = w.shape
    T = y.shape[0]
    x32 = x.to(_F32)
    S = w.reshape(groups, -1, K).sum(1, dtype=torch.float64).to(_F32)  # (G, K)
    if x.dtype == torch.bfloat16 and not interpreting():  # as the kernel: S split hi + lo
        hi = S.to(torch.bfloat16).to(_F32)
        S = hi + (S - hi).to(torch.bfloat16).to(_F32)
    ref = (x.to(y.dtype) if round_code(x.dtype, y.dtype) else x).to(_F32) @ S.t()
    wq = (w * w).reshape(groups, -1).sum(1)
    bq = torch.zeros(groups) if bias is None else (bias.to(_F32) ** 2).view(groups, -1).sum(1)
    if bias is not None:
        ref = ref + bias.view(groups, -1).sum(1, dtype=torch.float64).to(_F32)
    norms = (wq + bq).sqrt() + _lost_w(N, K, groups) + floor
    xn1 = torch.linalg.vector_norm(x32, dim=1) + squares_lost(K) + 1
    y3 = y.to(_F32).view(T, groups, -1)
    res = y3.sum(-1) - ref
    mag = xn1[:, None] * norms
    l1 = torch.minimum(y3.abs().sum(-1), cap * mag)
    exc = res.abs() - absf * l1 - factor * mag
    return {"ref": ref, "res": res, "exc": exc, "xn1": xn1}
