"""The forward check of one projection y (T, N) = x (T, K) W^T + b in three kernels, each a
registered op (``check_impl="triton"``'s :func:`attnchecker.attention.checks.projection_check_`).

The N outputs are G head groups of n; a row is a (token, group) pair, checked against
x_t . (sum_{o in g} W_o) + sum_{o in g} b_o with the tolerance of the eager check (its
``factor`` and ``floor``, :func:`~attnchecker.attention.checks.row_factor`):
factor (||x_t|| + 1) ||[W_g | b_g]||_F.

1. ``attnchecker::proj_weights`` (:func:`weights_kernel`), one pass over W once per step (the
   caller caches it on the step clock: weights do not change between a forward and its backward,
   and fused optimizers do not bump version counters): per group, the sums of W over the group's
   outputs S (G, K), of b, of b's squares and of W's squares, and W's row sums W 1 (N,). The
   tail [W 1 | squares] is :func:`attnchecker.kernels.gemm_check.gemm_refs` of W, so the
   backward's dX check (dX = dY W) reuses it;
2. ``attnchecker::proj_verify`` (:func:`verify_kernel`), one pass over the rows of y and of x:
   each (token, group)'s sum, reference and excess, and per program the tokens it flags for each
   site (no atomics, nothing written to the log on a clean call);
3. ``attnchecker::proj_repair`` (:func:`repair_kernel`), predicated on the flag (the programs'
   counts): it returns at once when they are 0. Else program 0 writes the detection into the log
   rows of the sites (flagged tokens, detected, step, the worst residual, NaN first), and every
   flagged token's row is recomputed from x, W and b, its elements compared with the delivered
   ones to locate bad columns (further apart than twice an element's rounding bound), and checked
   again: what still fails is lost and reproduced.

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
from attnchecker.kernels.triton_utils import (
    as_i64,
    block_product,
    readable,
    span,
    tile,
    worst_residual,
)

__all__ = ["check_", "norms", "proj_repair", "proj_verify", "proj_weights", "reference", "refs_of"]

_BM, _BN, _BK, _BO, _BP = 32, 64, 64, 32, 64
_F32 = torch.float32


@triton.jit
def weights_kernel(W, B, OUT, N, K, G, n, sw_o, sw_k, HAS_B: tl.constexpr, BO: tl.constexpr,
                   BK: tl.constexpr):  # fmt: skip
    """Program g, one pass over the group's rows of W: S[g] (K,) summed over the group's
    outputs, each output's row sum, the squares, the bias's sum and squares (OUT: [S (G K) |
    b sums (G) | b squares (G) | W 1 (N) | W squares (G)])."""
    g = tl.program_id(0).to(tl.int64)
    base = as_i64(G) * K
    sq = tl.zeros([BK], dtype=tl.float32)
    for o0 in range(0, n, BO):
        os, omask = span(o0, n, BO)
        w1 = tl.zeros([BO], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ks, kmask = span(k0, K, BK)
            t = tile(W, g * n + os, ks, sw_o, sw_k, omask, kmask).to(tl.float32)
            w1 += tl.sum(t, 1)
            sq += tl.sum(t * t, 0)
            at = OUT + g * K + ks  # this program's own S row: read, add, write back
            s = tl.sum(t, 0)
            if o0 > 0:
                s += tl.load(at, mask=kmask, other=0.0)
            tl.store(at, s, mask=kmask)
            tl.debug_barrier()  # the next chunk of outputs reads what this one wrote
        tl.store(OUT + (g * n + os + (base + 2 * G)), w1, mask=omask)
    bs = tl.zeros([BO], dtype=tl.float32)
    bq = tl.zeros([BO], dtype=tl.float32)
    if HAS_B:
        for o0 in range(0, n, BO):
            os, omask = span(o0, n, BO)
            b = tl.load(B + g * n + os, mask=omask, other=0.0).to(tl.float32)
            bs += b
            bq += b * b
    tl.store(OUT + (g + base), tl.sum(bs, 0))
    tl.store(OUT + (g + (base + G)), tl.sum(bq, 0))
    tl.store(OUT + (g + (base + 2 * G + N)), tl.sum(sq, 0))


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
def verify_kernel(Y, X, WS, SITE, SCR, BITS, T, N, K, G, n, P, sy_t, sy_n, sx_t, sx_k, lost_x,
                  lost_w, factor, floor, chunk,
                  S: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GP: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    rows, rmask = span(pid.to(tl.int64) * BM, T, BM)
    gs, gmask = span(0, G, GP)
    ref = tl.zeros([BM, GP], dtype=tl.float32)
    sq = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(0, K, BK):  # x_t . S_g for every group: one thin product
        ks, kmask = span(k0, K, BK)
        t = tile(X, rows, ks, sx_t, sx_k, rmask, kmask)
        s = tile(WS, ks, gs, 1, K, kmask, gmask)  # S stored (G, K): read as (BK, GP)
        if BF16:  # the eager reference's dtype (S rounded to bf16, products exact in fp32)
            ref += tl.dot(t, s.to(tl.bfloat16))
        else:
            ref += tl.dot(t.to(tl.float32), s, input_precision="ieee")
        t = t.to(tl.float32)
        sq += tl.sum(t * t, 1)
    ref += tl.load(WS + (gs + G * K), mask=gmask, other=0.0)[None, :]
    rs = tl.zeros([BM, GP], dtype=tl.float32)
    for g in range(0, G):  # each group's sum of its n outputs
        acc = tl.zeros([BM], dtype=tl.float32)
        for c0 in range(0, n, BN):
            cs, cmask = span(c0, n, BN)
            acc += tl.sum(tile(Y, rows, g * n + cs, sy_t, sy_n, rmask, cmask).to(tl.float32), 1)
        rs += tl.where(gs[None, :] == g, acc[:, None], 0.0)
    xn1 = tl.sqrt(sq) + lost_x + 1.0
    res = rs - ref
    norms = _norms(WS, gs, gmask, G, K, N, lost_w, floor)
    exc = tl.abs(res) - factor * xn1[:, None] * norms[None, :]
    at = rows[:, None] * G + gs[None, :]
    both = rmask[:, None] & gmask[None, :]
    tl.store(SCR + at, ref, mask=both)
    tl.store(SCR + (at + T * G), res, mask=both)
    tl.store(SCR + (at + 2 * T * G), exc, mask=both)
    tl.store(SCR + (rows + 3 * T * G), xn1, mask=rmask)
    flagged = ~(exc <= 0.0) & both  # NaN compares False: flagged
    site = tl.load(SITE + gs, mask=gmask, other=-1)
    base = 3 * T * G + T
    for s in tl.static_range(S):  # tokens with a flagged group of site s
        hit = tl.max((flagged & (site[None, :] == s)).to(tl.int32), 1)
        tl.store(SCR + (pid.to(tl.int64) * S + s + base), tl.sum(hit, 0).to(tl.float32))
    if pid == 0:
        for s in tl.static_range(S):  # each site's lost flag, for the repair
            tl.store(SCR + (as_i64(P) * S + s + base), 0.0)
    for j0 in range(0, chunk, BN):  # this program's chunk of the column bitmap
        js, jmask = span(pid.to(tl.int64) * chunk + j0, N, BN)
        tl.store(BITS + js, tl.zeros([BN], dtype=tl.int32), mask=jmask & (js < (pid + 1) * chunk))


@triton.jit
def repair_kernel(Y, X, W, B, WS, SITE, SCR, BITS, LOG, STEP, T, N, K, G, n, P, sy_t, sy_n, sx_t,
                  sx_k, sw_o, sw_k, lost_w, factor, floor, near_f, row0, row1, row2,
                  S: tl.constexpr, HAS_B: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                  GP: tl.constexpr):  # fmt: skip
    base = 3 * T * G + T
    total = tl.zeros([], dtype=tl.float32)
    for p0 in range(0, P * S, BP):  # the flag: every program's counts
        ps, pmask = span(p0, P * S, BP)
        total += tl.sum(tl.load(SCR + (ps + base), mask=pmask, other=0.0), 0)
    if total > 0:
        pid = tl.program_id(0)
        if pid == 0:
            _record(SCR, LOG, STEP, T, G, P, base, row0, row1, row2, S, BP)
        rows, rmask = span(pid.to(tl.int64) * BM, T, BM)
        gs, gmask = span(0, G, GP)
        both = rmask[:, None] & gmask[None, :]
        exc = tl.load(SCR + (rows[:, None] * G + gs[None, :] + 2 * T * G), mask=both, other=0.0)
        bad = tl.max((~(exc <= 0.0) & both).to(tl.int32), 1) > 0  # (BM,) tokens to recompute
        if tl.sum(bad.to(tl.int32), 0) > 0:
            xn1 = tl.load(SCR + (rows + 3 * T * G), mask=rmask, other=0.0)
            norms = _norms(WS, gs, gmask, G, K, N, lost_w, 0.0)  # (GP,)
            sums = tl.zeros([BM, GP], dtype=tl.float32)
            for n0 in range(0, N, BN):
                cols, cmask = span(n0, N, BN)
                # W^T's columns: W (N, K) read as (K, N) through its strides
                acc = block_product(X, W, rows, bad, cols, cmask, K, sx_t, sx_k, sw_k, sw_o, IEEE,
                                    BM, BN, BK)  # fmt: skip
                if HAS_B:
                    acc += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
                new = acc.to(Y.dtype.element_ty)
                at = Y + rows[:, None] * sy_t + cols[None, :] * sy_n
                live = bad[:, None] & cmask[None, :]
                old = tl.load(at, mask=live, other=0.0).to(tl.float32)
                group = cols // n  # (BN,)
                # an element's rounding bound: the group's (||x_t|| + 1) ||[W_g | b_g]|| share
                cn = _norms(WS, group, cmask, G, K, N, lost_w, 0.0)
                near = 2 * near_f * xn1[:, None] * cn[None, :] + floor
                far = ~(tl.abs(old - new.to(tl.float32)) <= near) & live
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
                sums += tl.dot(tl.where(live, new.to(tl.float32), 0.0), onehot,
                               input_precision="ieee")  # fmt: skip
            ref = tl.load(SCR + rows[:, None] * G + gs[None, :], mask=both, other=0.0)
            still = ~(tl.abs(sums - ref) - factor * xn1[:, None] * (norms + floor)[None, :] <= 0)
            still = still & bad[:, None] & both
            site = tl.load(SITE + gs, mask=gmask, other=-1)
            for s in tl.static_range(S):
                row = _site_row(s, row0, row1, row2)
                lost = tl.sum((still & (site[None, :] == s)).to(tl.int32), 1)
                if (tl.sum(lost, 0) > 0) & (row >= 0):
                    one = tl.full([], 1.0, tl.float32)
                    first = tl.atomic_add(SCR + (as_i64(P) * S + s + base), one)
                    if first == 0:  # once per site: lost, and reproduced (the operands imply it)
                        tl.atomic_add(LOG + row * 7 + 3, 1.0)
                        tl.atomic_add(LOG + row * 7 + 4, 1.0)


@triton.jit
def _record(SCR, LOG, STEP, T, G, P, base, row0, row1, row2, S: tl.constexpr, BP: tl.constexpr):
    """The detection into the sites' log rows (program 0 of a flagged repair): flagged tokens,
    the worst residual (NaN first), detected once, the step."""
    value = worst_residual(SCR, 2 * T * G, T * G, T * G, BP)
    step = tl.load(STEP)
    for s in tl.static_range(S):
        row = _site_row(s, row0, row1, row2)
        count = tl.zeros([], dtype=tl.float32)
        for p0 in range(0, P, BP):
            ps, pmask = span(p0, P, BP)
            count += tl.sum(tl.load(SCR + (ps * S + s + base), mask=pmask, other=0.0), 0)
        if (count > 0) & (row >= 0):
            at = LOG + row * 7
            tl.atomic_add(at, count.to(tl.float64))
            tl.atomic_add(at + 2, value.to(tl.float64))
            tl.atomic_add(at + 5, 1.0)
            tl.atomic_add(at + 6, step)


def _as_rows(weight: Tensor, conv1d: bool) -> Tensor:
    """The weight as (N, K) (a view: Conv1D stores it (K, N))."""
    return weight.t() if conv1d else weight


@torch.library.custom_op("attnchecker::proj_weights", mutates_args=())
def proj_weights(weight: Tensor, bias: Tensor | None, groups: int, conv1d: bool) -> Tensor:
    """The packed weight-side sums of a projection of ``groups`` head groups (see
    :func:`weights_kernel`), fp32."""
    w = readable(_as_rows(weight, conv1d))
    N, K = w.shape
    out = torch.empty(groups * (K + 3) + N, device=w.device, dtype=_F32)
    b = readable(bias)
    weights_kernel[(groups,)](w, b if b is not None else out, out, N, K, groups, N // groups,
                              w.stride(0), w.stride(1), HAS_B=bias is not None, BO=_BO,
                              BK=_BK)  # fmt: skip
    return out


@proj_weights.register_fake
def _(weight, bias, groups, conv1d):
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


@torch.library.custom_op("attnchecker::proj_verify", mutates_args=())
def proj_verify(
    y: Tensor, x: Tensor, ws: Tensor, site: Tensor, n_sites: int, factor: float, floor: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The rows' check of y (T, N) = x (T, K) W^T + b against ``ws`` (:func:`proj_weights`);
    ``site`` (G,) int32: the site each group is counted by. Returns the scratch (references,
    residuals and excesses (T, G), ||x_t|| + 1 (T,), each program's flagged tokens per site,
    the sites' lost flags) and the column bitmap (N,) int32, zeroed, for :func:`proj_repair`."""
    T, N = y.shape
    K = x.shape[1]
    G = site.shape[0]
    P = triton.cdiv(T, _BM) if T else 1
    scr = torch.empty(3 * T * G + T + (P + 1) * n_sites, device=y.device, dtype=_F32)
    bits = torch.empty(N, device=y.device, dtype=torch.int32)
    yr, xr = readable(y), readable(x)
    verify_kernel[(P,)](yr, xr, ws, site, scr, bits, T, N, K, G, N // G, P, yr.stride(0),
                        yr.stride(1), xr.stride(0), xr.stride(1), squares_lost(K),
                        _lost_w(N, K, G), factor, floor, triton.cdiv(N, P), S=n_sites,
                        BF16=xr.dtype == torch.bfloat16, BM=_BM, BN=_BN, BK=_BK,
                        GP=_gp(G))  # fmt: skip
    return scr, bits


@proj_verify.register_fake
def _(y, x, ws, site, n_sites, factor, floor):
    T, N = y.shape
    G, P = site.shape[0], triton.cdiv(T, _BM) if T else 1
    return (y.new_empty(3 * T * G + T + (P + 1) * n_sites, dtype=_F32),
            y.new_empty(N, dtype=torch.int32))  # fmt: skip


def _lost_w(N: int, K: int, G: int) -> float:
    """What a group's squares can lose to underflow: its n outputs' norms over K (the eager
    check's per-output bound) and their norm over n."""
    n = N // G
    return math.sqrt(n) * squares_lost(K) + squares_lost(n)


@torch.library.custom_op("attnchecker::proj_repair", mutates_args=("y", "scr", "bits", "log"))
def proj_repair(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, ws: Tensor,
    site: Tensor, scr: Tensor, bits: Tensor, log: Tensor, step: Tensor, rows: list[int],
    factor: float, floor: float,
) -> None:  # fmt: skip
    """Record, recompute, locate and re-check what :func:`proj_verify` flagged (nothing on a
    clean call: every program returns at once), into y and the log rows ``rows`` of the sites."""
    T, N = y.shape
    K = x.shape[1]
    G, S = site.shape[0], len(rows)
    P = triton.cdiv(T, _BM) if T else 1
    yr, xr, b = readable(y), readable(x), readable(bias)
    w = readable(_as_rows(weight, conv1d))
    ieee = torch.float32 in (xr.dtype, w.dtype)
    if xr.dtype != w.dtype:
        xr, w = xr.to(_F32), w.to(_F32)
    r = [*rows, -1, -1][:3]
    repair_kernel[(P,)](yr, xr, w, b if b is not None else ws, ws, site, scr, bits, log, step,
                        T, N, K, G, N // G, P, yr.stride(0), yr.stride(1), xr.stride(0),
                        xr.stride(1), w.stride(0), w.stride(1), _lost_w(N, K, G), factor, floor,
                        factor / math.sqrt(N // G), *r, S=S, HAS_B=bias is not None, IEEE=ieee,
                        BM=_BM, BN=_BN, BK=_BK, BP=_BP, GP=_gp(G))  # fmt: skip
    if yr is not y:  # the interpreter's fp32 copy
        y.copy_(yr)


def check_(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, ws: Tensor,
    sites: tuple[int, ...], log: Tensor, step: Tensor, rows: list[int], *, factor: float,
    floor: float,
) -> Tensor:  # fmt: skip
    """Check and repair y (T, N) = x (T, K) W^T + b in place, into the log rows ``rows`` of its
    sites (``sites``: the site of each head group, indices into ``rows``); returns the scratch
    (the references (T, G) first; :func:`proj_verify`)."""
    site = _site_of(sites, y.device)
    scr, bits = proj_verify(y, x, ws, site, len(rows), factor, floor)
    proj_repair(y, x, weight, bias, conv1d, ws, site, scr, bits, log, step, rows, factor, floor)
    return scr


def reference(
    y: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, conv1d: bool, groups: int, *,
    factor: float, floor: float,
) -> dict[str, Tensor]:  # fmt: skip
    """What the verify kernel computes, with torch ops (for the tests): references, residuals
    and excesses (T, G), ||x_t|| + 1 (T,)."""
    w = _as_rows(weight, conv1d).to(_F32)
    N, K = w.shape
    T = y.shape[0]
    x32 = x.to(_F32)
    S = w.reshape(groups, -1, K).sum(1)  # (G, K)
    if x.dtype == torch.bfloat16 and not interpreting():  # as the kernel: S rounded to bf16
        S = S.to(torch.bfloat16).to(_F32)
    ref = x32 @ S.t()
    wq = (w * w).reshape(groups, -1).sum(1)
    bq = torch.zeros(groups) if bias is None else (bias.to(_F32) ** 2).view(groups, -1).sum(1)
    if bias is not None:
        ref = ref + bias.to(_F32).view(groups, -1).sum(1)
    norms = (wq + bq).sqrt() + _lost_w(N, K, groups) + floor
    xn1 = torch.linalg.vector_norm(x32, dim=1) + squares_lost(K) + 1
    res = y.to(_F32).view(T, groups, -1).sum(-1) - ref
    return {"ref": ref, "res": res, "exc": res.abs() - factor * xn1[:, None] * norms, "xn1": xn1}
