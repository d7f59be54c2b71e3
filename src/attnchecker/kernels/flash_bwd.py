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
the probability invariant (the forward normalised fp32 P over the same keys; the recompute
may round S differently by a few ulps of |q||k|, and exp2 is approximate on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnchecker.kernels.common import (
    TAU_ABS,
    allowed,
    count,
    fails,
    fresh_product,
    inject,
    load_fault,
    row,
    site,
    tile,
    tile_check,
)  # fmt: skip

_ST, _DPT, _DV, _DK = row("st"), row("dpt"), row("dv"), row("dk")
_P_SUM, _DS_SUM, _DQ = row("p_sum"), row("ds_sum"), row("dq")
SITE_ST, SITE_DPT, SITE_DV, SITE_DK = site("st"), site("dpt"), site("dv"), site("dk")
SITE_SQ, SITE_DP, SITE_DQ = site("sq"), site("dp"), site("dq")


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb,
    H, HKV, L, LK, D, GROUP, qk_scale, scale, window, tau, tau_acc,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_ST: tl.constexpr, CHECK_DPT: tl.constexpr, CHECK_DV: tl.constexpr,
    CHECK_DK: tl.constexpr, INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    hk = (bhk % HKV).to(tl.int64)
    col0 = pid_n * BLOCK_N
    rows = tl.arange(0, BLOCK_M)  # in-tile offsets
    cols = tl.arange(0, BLOCK_N)
    offs_n = col0 + cols
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_n < LK
    d_ok = offs_d < D
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k_at = K + b * skb + hk * skh + tl.cast(col0, tl.int64) * skn
    v_at = V + b * svb + hk * svh + tl.cast(col0, tl.int64) * svn
    k = tile(k_at, cols, skn, offs_d, skd, kv_mask, UPCAST, False)
    v = tile(v_at, cols, svn, offs_d, svd, kv_mask, UPCAST, False)
    k32 = k.to(tl.float32)
    v32 = v.to(tl.float32)
    k_bar = tl.sum(k32, 0)  # (BLOCK_D,): the tile checks' references need only these
    k_mag = tl.sum(tl.abs(k32), 0)
    v_bar = tl.sum(v32, 0)
    v_mag = tl.sum(tl.abs(v32), 0)
    shift = LK - L
    lo = 0
    if CAUSAL:  # query rows before the first key of this block see none of it
        lo = tl.maximum(0, col0 - shift) // BLOCK_M * BLOCK_M

    fault = load_fault(FAULT, INJECT)
    CHECK_DEFERRED: tl.constexpr = CHECK_DV or CHECK_DK
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    c_dk = tl.zeros([BLOCK_N], tl.float32)
    t_dk = tl.zeros([BLOCK_N], tl.float32)
    c_dv = tl.zeros([BLOCK_N], tl.float32)
    t_dv = tl.zeros([BLOCK_N], tl.float32)
    first_dv = tl.full([], 0, tl.int32)
    first_dk = tl.full([], 0, tl.int32)
    attempt = 0
    todo = 1
    while todo > 0:
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        c_dk = tl.zeros([BLOCK_N], tl.float32)
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
                # S^T (BLOCK_N, BLOCK_M)
                st = tl.dot(k, tl.trans(q), input_precision=DOT)
                if INJECT:
                    st = inject(st, fault, SITE_ST, bh, offs_n, offs_m, attempt, True)
                if CHECK_ST and tile_check(st, k_bar, k_mag, q, row_ok, tau) > 0:
                    count(COUNTS, _ST, 0)  # recompute from fresh loads, check again
                    st = fresh_product(k_at, cols, skn, kv_mask, q_at, rows, sqm, qm, offs_d,
                                       skd, sqd, UPCAST, DOT)  # fmt: skip
                    if INJECT:
                        st = inject(st, fault, SITE_ST, bh, offs_n, offs_m, 1, True)
                    still = tile_check(st, k_bar, k_mag, q, row_ok, tau) > 0
                    count(COUNTS, _ST, 1 + still.to(tl.int32))
                ok = tl.trans(allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                                       CAUSAL, WINDOW, HAS_MASK))  # fmt: skip
                pt = tl.where(ok, tl.exp2(st * qk_scale - lse[None, :]), 0.0)
                pt_lo = pt.to(do.dtype)
                dv = tl.dot(pt_lo, do, dv, input_precision=DOT)
                if INJECT:
                    dv = inject(dv, fault, SITE_DV, bh, offs_n, offs_d, attempt, start == lo)
                # dP^T (BLOCK_N, BLOCK_M)
                dpt = tl.dot(v, tl.trans(do), input_precision=DOT)
                if INJECT:
                    dpt = inject(dpt, fault, SITE_DPT, bh, offs_n, offs_m, attempt, True)
                if CHECK_DPT and tile_check(dpt, v_bar, v_mag, do, row_ok, tau) > 0:
                    count(COUNTS, _DPT, 0)
                    dpt = fresh_product(v_at, cols, svn, kv_mask, do_at, rows, sdm, qm, offs_d,
                                        svd, sdd, UPCAST, DOT)  # fmt: skip
                    if INJECT:
                        dpt = inject(dpt, fault, SITE_DPT, bh, offs_n, offs_m, 1, True)
                    still = tile_check(dpt, v_bar, v_mag, do, row_ok, tau) > 0
                    count(COUNTS, _DPT, 1 + still.to(tl.int32))
                dst = pt * (dpt - delta[None, :])
                dst_lo = dst.to(q.dtype)
                dk = tl.dot(dst_lo, q, dk, input_precision=DOT)
                if INJECT:
                    dk = inject(dk, fault, SITE_DK, bh, offs_n, offs_d, attempt, start == lo)
                if CHECK_DEFERRED:
                    p32 = pt_lo.to(tl.float32)
                    do32 = do.to(tl.float32)
                    c_dv += tl.sum(p32 * tl.sum(do32, 1)[None, :], 1)
                    t_dv += tl.sum(p32 * tl.sum(tl.abs(do32), 1)[None, :], 1)
                    ds32 = dst_lo.to(tl.float32)
                    q32 = q.to(tl.float32)
                    c_dk += tl.sum(ds32 * tl.sum(q32, 1)[None, :], 1)
                    t_dk += tl.sum(tl.abs(ds32) * tl.sum(tl.abs(q32), 1)[None, :], 1)
        todo = 0
        if CHECK_DEFERRED:
            n_dv = 0
            n_dk = 0
            if CHECK_DV:
                n_dv = tl.sum((fails(tl.sum(dv, 1) - c_dv, tau_acc * t_dv + TAU_ABS) & key_ok)
                              .to(tl.int32), 0)  # fmt: skip
            if CHECK_DK:
                n_dk = tl.sum((fails(tl.sum(dk, 1) - c_dk, tau_acc * t_dk + TAU_ABS) & key_ok)
                              .to(tl.int32), 0)  # fmt: skip
            if attempt == 0:
                first_dv = n_dv
                first_dk = n_dk
                if n_dv > 0:
                    count(COUNTS, _DV, 0)
                if n_dk > 0:
                    count(COUNTS, _DK, 0)
                if n_dv + n_dk > 0:
                    todo = 1
            else:
                if first_dv > 0:
                    count(COUNTS, _DV, 1 + (n_dv > 0).to(tl.int32))
                if first_dk > 0:
                    count(COUNTS, _DK, 1 + (n_dk > 0).to(tl.int32))
        attempt += 1

    dk_at = DK + b * skb + hk * skh + tl.cast(col0, tl.int64) * skn
    tl.store(dk_at + cols[:, None] * skn + offs_d[None, :] * skd,
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)  # fmt: skip
    dv_at = DV + b * svb + hk * svh + tl.cast(col0, tl.int64) * svn
    tl.store(dv_at + cols[:, None] * svn + offs_d[None, :] * svd, dv.to(DV.dtype.element_ty),
             mask=kv_mask)  # fmt: skip


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DELTA_ABS, DQ, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb,
    H, L, LK, D, GROUP, qk_scale, scale, window, tau_acc, tau_p, tau_out,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_P: tl.constexpr, CHECK_DS: tl.constexpr, CHECK_DQ: tl.constexpr,
    INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP
    row0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    offs_m = row0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < D
    qm = row_ok[:, None] & d_ok[None, :]
    q = tile(Q + b * sqb + h * sqh + tl.cast(row0, tl.int64) * sqm, rows, sqm, offs_d, sqd, qm,
             UPCAST, False)  # fmt: skip
    do = tile(DO + b * sdb + h * sdh + tl.cast(row0, tl.int64) * sdm, rows, sdm, offs_d, sdd, qm,
              UPCAST, False)  # fmt: skip
    at_rows = bh.to(tl.int64) * L + offs_m
    lse = tl.load(LSE + at_rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + at_rows, mask=row_ok, other=0.0)
    delta_abs = tl.load(DELTA_ABS + at_rows, mask=row_ok, other=0.0)
    shift = LK - L
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, row0 + BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, (row0 + shift - window + 1) // BLOCK_N * BLOCK_N)
    k_at = K + b * skb + hk * skh
    v_at = V + b * svb + hk * svh

    fault = load_fault(FAULT, INJECT)
    CHECK_ANY: tl.constexpr = CHECK_P or CHECK_DS or CHECK_DQ
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    p_sum = tl.zeros([BLOCK_M], tl.float32)
    ds_sum = tl.zeros([BLOCK_M], tl.float32)
    ds_mag = tl.zeros([BLOCK_M], tl.float32)
    c_dq = tl.zeros([BLOCK_M], tl.float32)
    t_dq = tl.zeros([BLOCK_M], tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.float32)
    first = tl.full([], 0, tl.int32)
    attempt = 0
    todo = 1
    while todo > 0:
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        p_sum = tl.zeros([BLOCK_M], tl.float32)
        ds_sum = tl.zeros([BLOCK_M], tl.float32)
        ds_mag = tl.zeros([BLOCK_M], tl.float32)
        c_dq = tl.zeros([BLOCK_M], tl.float32)
        t_dq = tl.zeros([BLOCK_M], tl.float32)
        n_valid = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + cols
            kv_mask = (offs_n < LK)[:, None] & d_ok[None, :]
            k = tile(k_at + tl.cast(start, tl.int64) * skn, cols, skn, offs_d, skd, kv_mask, UPCAST,
                     False)  # fmt: skip
            v = tile(v_at + tl.cast(start, tl.int64) * svn, cols, svn, offs_d, svd, kv_mask, UPCAST,
                     False)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT)
            if INJECT:
                s = inject(s, fault, SITE_SQ, bh, offs_m, offs_n, attempt, True)
            ok = allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                          CAUSAL, WINDOW, HAS_MASK)  # fmt: skip
            p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT)
            if INJECT:
                dp = inject(dp, fault, SITE_DP, bh, offs_m, offs_n, attempt, True)
            ds = p * (dp - delta[:, None])
            ds_lo = ds.to(k.dtype)
            dq = tl.dot(ds_lo, k, dq, input_precision=DOT)
            if INJECT:
                dq = inject(dq, fault, SITE_DQ, bh, offs_m, offs_d, attempt, start == lo)
            if CHECK_ANY:
                p_sum += tl.sum(p, 1)
                ds_sum += tl.sum(ds, 1)
                ds_mag += tl.sum(tl.abs(p * dp), 1)
                n_valid += tl.sum(ok.to(tl.float32), 1)
                ds32 = ds_lo.to(tl.float32)
                k32 = k.to(tl.float32)
                c_dq += tl.sum(ds32 * tl.sum(k32, 1)[None, :], 1)
                t_dq += tl.sum(tl.abs(ds32) * tl.sum(tl.abs(k32), 1)[None, :], 1)
        todo = 0
        if CHECK_ANY:
            any_key = n_valid > 0
            n_p = 0
            n_ds = 0
            n_dq = 0
            if CHECK_P:
                n_p = tl.sum((any_key & fails(p_sum - 1.0, tau_p)).to(tl.int32), 0)
            if CHECK_DS:
                # Delta comes from O as stored (rounded to its dtype): tau_out sum_d |dO O| of it
                tol_ds = tau_acc * (ds_mag + tl.abs(delta)) + tau_out * delta_abs + TAU_ABS
                n_ds = tl.sum((any_key & fails(ds_sum, tol_ds)).to(tl.int32), 0)
            if CHECK_DQ:
                n_dq = tl.sum((row_ok & fails(tl.sum(dq, 1) - c_dq, tau_acc * t_dq + TAU_ABS))
                              .to(tl.int32), 0)  # fmt: skip
            code = (
                (n_p > 0).to(tl.int32) + 2 * (n_ds > 0).to(tl.int32) + 4 * (n_dq > 0).to(tl.int32)
            )
            if attempt == 0:
                first = code
                if n_p > 0:
                    count(COUNTS, _P_SUM, 0)
                if n_ds > 0:
                    count(COUNTS, _DS_SUM, 0)
                if n_dq > 0:
                    count(COUNTS, _DQ, 0)
                if code > 0:
                    todo = 1
            else:
                if first % 2 == 1:
                    count(COUNTS, _P_SUM, 1 + (n_p > 0).to(tl.int32))
                if (first // 2) % 2 == 1:
                    count(COUNTS, _DS_SUM, 1 + (n_ds > 0).to(tl.int32))
                if first // 4 == 1:
                    count(COUNTS, _DQ, 1 + (n_dq > 0).to(tl.int32))
        attempt += 1

    dq_at = DQ + b * sqb + h * sqh + tl.cast(row0, tl.int64) * sqm
    tl.store(dq_at + rows[:, None] * sqm + offs_d[None, :] * sqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=qm)  # fmt: skip
