"""The checked flash attention backward: two Triton kernels, dK/dV and dQ, with P recomputed
from S and the forward's log-sum-exp (``../shared/spec/fused-attention.md`` section 3.3).

dK/dV program: owns a block of BLOCK_N keys of one K/V head and walks every query block of the
query heads that share it (GQA), with

- **S^T** = K_n Q_m^T: column sums against k-bar . q_i (k-bar = sum of the program's keys,
  computed once), bound |k|-bar . |q_i| (P^T, hence dV and dK, come from it); recomputed at
  once on failure from K and Q re-read from memory (volatile loads, never merged with the
  first GEMM);
- **dP^T** = V_n dO_m^T: column sums against v-bar . dO_i, bound |v|-bar . |dO_i|; recomputed
  from V and dO re-read;
- **dV** += P~^T dO, deferred: c_j += sum_i P~_ji (dO_i . 1), exact bound sum_i P~_ji |dO_i| . 1;
- **dK** += dS~^T Q, deferred: c_j += sum_i dS~_ji (q_i . 1), bound sum_i |dS~_ji| (|q_i| . 1).

dQ program: owns BLOCK_M query rows and walks every key tile; it sees all keys of its rows, so
two invariants guard its S and dP without per-tile checksums:

- **sum_j P_ij = 1** after the sweep (fp32 P before rounding): guards S, exp2, the log-sum-exp
  and K / Q consistency with the forward;
- **sum_j dS_ij = 0**, since sum_j P_ij dP_ij = Delta_i: guards dP and the Delta pre-pass,
  within tau (sum_j |P_ij dP_ij| + |Delta_i|) plus the rounding of the stored O that Delta
  is computed from, 2 u(O) sum_d |dO_id O_id|;
- **dQ** += dS~ K, deferred: c_i += sum_j dS~_ij (k_j . 1), bound sum_j |dS~_ij| (|k_j| . 1).

A deferred failure re-runs the program's loop once (every input is read-only); a tile check
recomputes the tile. Counters, 64-bit offsets and tolerances as the forward's (``flash_fwd``:
``tau`` for tiles, ``tau_acc`` for the deferred checks and the dS invariant); ``tau_p`` for
the probability invariant (the forward normalised fp32 P over the same keys; exp2 is
approximate on a GPU), plus ``tau_logit`` |q_i| sum_j min(P_ij, 1) |k_j| for the recomputed
logits, which may round differently from the forward's by a few ulps of |q_i||k_j| (another
tile shape or order: the H200's first run saw sum_j P_ij off 1 by more than tau_p at input
scale 100, never in the interpreter, which computes both alike).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnchecker.kernels.common import (
    TAU_ABS,
    accumulate,
    allowed,
    carry,
    checked_product,
    fails,
    key_range,
    load_fault,
    off_rows,
    product,
    program_block,
    row,
    site,
    sums,
    tally,
    tile,
    transposed,
)  # fmt: skip

_ST, _DPT, _DV, _DK = row("st"), row("dpt"), row("dv"), row("dk")
_P_SUM, _DS_SUM, _DQ = row("p_sum"), row("ds_sum"), row("dq")
SITE_ST, SITE_DPT, SITE_DV, SITE_DK = site("st"), site("dpt"), site("dv"), site("dk")
SITE_SQ, SITE_DP, SITE_DQ = site("sq"), site("dp"), site("dq")


@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    H, HKV, L, LK, D, GROUP, qk_scale, scale, window, tau, tau_acc,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_ST: tl.constexpr, CHECK_DPT: tl.constexpr, CHECK_DV: tl.constexpr,
    CHECK_DK: tl.constexpr, INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    _bhk, b, hk, col0, offs_n, offs_d, key_ok, d_ok, kv_mask = program_block(
        HKV, LK, D, BLOCK_N, BLOCK_D
    )
    rows = tl.arange(0, BLOCK_M)  # in-tile offsets
    cols = tl.arange(0, BLOCK_N)
    k_at = K + b * skb + hk * skh + tl.cast(col0, tl.int64) * skn
    v_at = V + b * svb + hk * svh + tl.cast(col0, tl.int64) * svn
    k = tile(k_at, cols, skn, offs_d, skd, kv_mask, UPCAST, False)  # (BLOCK_N, BLOCK_D)
    v = tile(v_at, cols, svn, offs_d, svd, kv_mask, UPCAST, False)
    k_bar, k_mag = sums(k)  # (BLOCK_D,) each: the tile checks' references need only these
    v_bar, v_mag = sums(v)
    shift = LK - L
    lo = 0
    if CAUSAL:  # query rows before the first key of this block see none of it
        lo = tl.maximum(0, col0 - shift) // BLOCK_M * BLOCK_M

    fault = load_fault(FAULT, INJECT)
    fault_t = transposed(fault)  # S^T and dP^T tiles: keys by queries
    CHECK_DEFERRED: tl.constexpr = CHECK_DV or CHECK_DK
    # read after the loop, so defined before it (Triton); each attempt restarts them
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = tl.full([], 0, tl.int32)  # the deferred checks that failed at attempt 0 (bits)
    attempt = 0
    todo = 1
    while todo > 0:
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        c_dk = tl.zeros([BLOCK_N], tl.float32)  # the deferred checks' checksums and bounds
        t_dk = tl.zeros([BLOCK_N], tl.float32)
        c_dv = tl.zeros([BLOCK_N], tl.float32)
        t_dv = tl.zeros([BLOCK_N], tl.float32)
        for g in range(GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            for start in range(lo, L, BLOCK_M):
                offs_m = start + rows
                row_ok = offs_m < L
                qm = row_ok[:, None] & d_ok[None, :]
                q_at = Q + b * sqb + h * sqh + tl.cast(start, tl.int64) * sqm
                do_at = DO + b * sdb + h * sdh + tl.cast(start, tl.int64) * sdm
                q = tile(q_at, rows, sqm, offs_d, sqd, qm, UPCAST, False)
                do = tile(do_at, rows, sdm, offs_d, sdd, qm, UPCAST, False)
                lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + bh * L + offs_m, mask=row_ok, other=0.0)
                # S^T (BLOCK_N, BLOCK_M), checked (and recomputed) by query columns
                st = checked_product(k, q, (k_at, cols, skn, offs_d, skd, kv_mask),
                                     (q_at, rows, sqm, offs_d, sqd, qm), k_bar, k_mag, row_ok,
                                     tau, fault_t, SITE_ST, bh, offs_n, offs_m, attempt, COUNTS,
                                     _ST, CHECK_ST, INJECT, UPCAST, DOT)  # fmt: skip
                ok = tl.trans(allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                                       CAUSAL, WINDOW, HAS_MASK))  # fmt: skip
                pt = tl.where(ok, tl.exp2(st * qk_scale - lse[None, :]), 0.0)
                pt_lo = pt.to(do.dtype)
                dv = accumulate(pt_lo, do, dv, fault, SITE_DV, bh, offs_n, offs_d, attempt,
                                start == lo, INJECT, DOT)  # fmt: skip
                # dP^T (BLOCK_N, BLOCK_M), checked (and recomputed) by query columns
                dpt = checked_product(v, do, (v_at, cols, svn, offs_d, svd, kv_mask),
                                      (do_at, rows, sdm, offs_d, sdd, qm), v_bar, v_mag, row_ok,
                                      tau, fault_t, SITE_DPT, bh, offs_n, offs_m, attempt, COUNTS,
                                      _DPT, CHECK_DPT, INJECT, UPCAST, DOT)  # fmt: skip
                dst = pt * (dpt - delta[None, :])
                dst_lo = dst.to(q.dtype)
                dk = accumulate(dst_lo, q, dk, fault, SITE_DK, bh, offs_n, offs_d, attempt,
                                start == lo, INJECT, DOT)  # fmt: skip
                if CHECK_DEFERRED:  # P~ >= 0 is its own magnitude, dS~ is not
                    p32 = pt_lo.to(tl.float32)
                    c_dv, t_dv = carry(c_dv, t_dv, p32, p32, do)
                    ds32 = dst_lo.to(tl.float32)
                    c_dk, t_dk = carry(c_dk, t_dk, ds32, tl.abs(ds32), q)
        todo = 0
        if CHECK_DEFERRED:
            n_dv = 0
            n_dk = 0
            if CHECK_DV:
                n_dv = off_rows(dv, c_dv, t_dv, tau_acc, key_ok)
            if CHECK_DK:
                n_dk = off_rows(dk, c_dk, t_dk, tau_acc, key_ok)
            first, todo = tally(COUNTS, (_DV, _DK), (n_dv, n_dk), attempt, first)
        attempt += 1

    # the gradients' own strides: K and V may alias themselves (expanded), dK and dV never do
    dk_at = DK + b * sdkb + hk * sdkh + tl.cast(col0, tl.int64) * sdkn
    tl.store(dk_at + cols[:, None] * sdkn + offs_d[None, :] * sdkd,
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)  # fmt: skip
    dv_at = DV + b * sdvb + hk * sdvh + tl.cast(col0, tl.int64) * sdvn
    tl.store(dv_at + cols[:, None] * sdvn + offs_d[None, :] * sdvd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)  # fmt: skip


@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DELTA_ABS, Q_NORM, K_NORM, DQ, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb, sdqb, sdqh, sdqm, sdqd,
    H, L, LK, D, GROUP, qk_scale, scale, window, tau_acc, tau_p, tau_logit, tau_out,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_P: tl.constexpr, CHECK_DS: tl.constexpr, CHECK_DQ: tl.constexpr,
    INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh, b, h, row0, offs_m, offs_d, row_ok, d_ok, qm = program_block(H, L, D, BLOCK_M, BLOCK_D)
    hk = h // GROUP
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    q = tile(Q + b * sqb + h * sqh + tl.cast(row0, tl.int64) * sqm, rows, sqm, offs_d, sqd, qm,
             UPCAST, False)  # fmt: skip
    do = tile(DO + b * sdb + h * sdh + tl.cast(row0, tl.int64) * sdm, rows, sdm, offs_d, sdd, qm,
              UPCAST, False)  # fmt: skip
    at_rows = bh.to(tl.int64) * L + offs_m
    lse = tl.load(LSE + at_rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + at_rows, mask=row_ok, other=0.0)
    delta_abs = tl.load(DELTA_ABS + at_rows, mask=row_ok, other=0.0)
    shift, lo, hi = key_range(row0, L, LK, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)
    k_at = K + b * skb + hk * skh
    v_at = V + b * svb + hk * svh

    fault = load_fault(FAULT, INJECT)
    CHECK_ANY: tl.constexpr = CHECK_P or CHECK_DS or CHECK_DQ
    # |q_i| and |k_j|, for the logits' rounding: read, not kept as fp32 tiles (registers)
    q_norm = tl.load(Q_NORM + at_rows, mask=row_ok, other=0.0)
    k_norm_at = K_NORM + (b * (H // GROUP) + hk) * LK
    # read after the loop, so defined before it (Triton); each attempt restarts it
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = tl.full([], 0, tl.int32)  # the checks that failed at attempt 0 (bits)
    attempt = 0
    todo = 1
    while todo > 0:
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        p_sum = tl.zeros([BLOCK_M], tl.float32)  # the invariants' sums, each row's keys
        ds_sum = tl.zeros([BLOCK_M], tl.float32)
        ds_mag = tl.zeros([BLOCK_M], tl.float32)
        c_dq = tl.zeros([BLOCK_M], tl.float32)  # the dQ check's checksum and bound
        t_dq = tl.zeros([BLOCK_M], tl.float32)
        n_valid = tl.zeros([BLOCK_M], tl.float32)
        k_reach = tl.zeros([BLOCK_M], tl.float32)  # sum_j min(P_ij, 1) |k_j|
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + cols
            kv_mask = (offs_n < LK)[:, None] & d_ok[None, :]
            k = tile(k_at + tl.cast(start, tl.int64) * skn, cols, skn, offs_d, skd, kv_mask, UPCAST,
                     False)  # fmt: skip
            v = tile(v_at + tl.cast(start, tl.int64) * svn, cols, svn, offs_d, svd, kv_mask, UPCAST,
                     False)  # fmt: skip
            # S and dP (BLOCK_M, BLOCK_N): no tile check, the invariants below guard them
            s = product(q, k, fault, SITE_SQ, bh, offs_m, offs_n, attempt, INJECT, DOT)
            ok = allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                          CAUSAL, WINDOW, HAS_MASK)  # fmt: skip
            p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            dp = product(do, v, fault, SITE_DP, bh, offs_m, offs_n, attempt, INJECT, DOT)
            ds = p * (dp - delta[:, None])
            ds_lo = ds.to(k.dtype)
            dq = accumulate(ds_lo, k, dq, fault, SITE_DQ, bh, offs_m, offs_d, attempt, start == lo,
                            INJECT, DOT)  # fmt: skip
            if CHECK_ANY:
                p_sum += tl.sum(p, 1)
                ds_sum += tl.sum(ds, 1)
                ds_mag += tl.sum(tl.abs(p * dp), 1)
                n_valid += tl.sum(ok.to(tl.float32), 1)
                k_norm = tl.load(k_norm_at + offs_n, mask=offs_n < LK, other=0.0)  # (BLOCK_N,)
                # P capped at 1 (a correct P is): a faulty huge P cannot widen its own bound
                k_reach += tl.sum(tl.minimum(p, 1.0) * k_norm[None, :], 1)
                ds32 = ds_lo.to(tl.float32)
                c_dq, t_dq = carry(c_dq, t_dq, ds32, tl.abs(ds32), k)
        todo = 0
        if CHECK_ANY:
            any_key = n_valid > 0
            n_p = 0
            n_ds = 0
            n_dq = 0
            # the recomputed logits round differently from the forward's (another tile shape
            # or order on the MMA): |S^b_ij - S^f_ij| <= 2 f |q_i| |k_j| moves sum_j P_ij by
            # at most ln 2 qk_scale of that, P-weighted (tau_logit = 2 ln 2 qk_scale f)
            logit_err = tau_logit * q_norm * k_reach
            if CHECK_P:
                n_p = tl.sum((any_key & fails(p_sum - 1.0, tau_p + logit_err)).to(tl.int32), 0)
            if CHECK_DS:
                # Delta comes from O as stored (rounded to its dtype): tau_out sum_d |dO O| of it
                tol_ds = tau_acc * (ds_mag + tl.abs(delta)) + tau_out * delta_abs + TAU_ABS
                tol_ds += tl.abs(delta) * logit_err  # Delta sum_j P_ij, sum_j P_ij off 1
                n_ds = tl.sum((any_key & fails(ds_sum, tol_ds)).to(tl.int32), 0)
            if CHECK_DQ:
                n_dq = off_rows(dq, c_dq, t_dq, tau_acc, row_ok)
            first, todo = tally(COUNTS, (_P_SUM, _DS_SUM, _DQ), (n_p, n_ds, n_dq), attempt, first)
        attempt += 1

    dq_at = DQ + b * sdqb + h * sdqh + tl.cast(row0, tl.int64) * sdqm
    tl.store(dq_at + rows[:, None] * sdqm + offs_d[None, :] * sdqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=qm)  # fmt: skip
