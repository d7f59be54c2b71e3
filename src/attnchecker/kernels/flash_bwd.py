"""The checked flash attention backward: two Triton kernels, dK/dV and dQ, with P recomputed
from S and the forward's log-sum-exp (``../shared/spec/fused-attention.md`` section 3.3).

dK/dV program: owns a block of BLOCK_N keys of one K/V head and walks every query block of the
query heads that share it (GQA), with

- **S^T** = K_n Q_m^T: row sums against k_j . q-bar_m, bound |k_j| . |q|-bar_m (P^T, hence dV
  and dK, come from it); recomputed at once on failure;
- **dP^T** = V_n dO_m^T: row sums against v_j . dO-bar_m, bound |v_j| . |dO|-bar_m; recomputed;
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
recomputes the tile. Counters as the forward's. Tolerances as the forward's (``flash_fwd``),
and 1e-3 for the probability invariant (the forward normalised fp32 P over the same keys; the
transposed recompute may round S differently by a few ulps of |q||k|).
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnchecker.kernels.common import at, corrupt, load_fault

ST_CHECK, DPT_CHECK, DV_CHECK, DK_CHECK, P_SUM, DS_SUM, DQ_CHECK = 3, 4, 5, 6, 7, 8, 9  # rows
SITE_ST, SITE_DPT, SITE_DV, SITE_DK, SITE_SQ, SITE_DP, SITE_DQ = 3, 4, 5, 6, 7, 8, 9
TAU_ABS = 1e-30
TAU_P = 1e-3


@triton.jit
def _allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
             CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr):  # fmt: skip
    """(len(offs_m), len(offs_n)) bool: query rows that may attend keys."""
    ok = (offs_m[:, None] < L) & (offs_n[None, :] < LK)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + shift)
    if WINDOW:
        ok = ok & (offs_n[None, :] > offs_m[:, None] + shift - window)
    if HAS_MASK:
        keep = tl.load(KMASK + b * smb + offs_n, mask=offs_n < LK, other=0)
        ok = ok & (keep[None, :] != 0)
    return ok


@triton.jit
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb,
    H, HKV, L, LK, D, GROUP, qk_scale, scale, window, tau,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // HKV
    hk = bhk % HKV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_n < LK
    d_ok = offs_d < D
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=kv_mask, other=0.0)  # fmt: skip
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
                mask=kv_mask, other=0.0)  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    k_abs = tl.abs(k).to(tl.float32)
    v_abs = tl.abs(v).to(tl.float32)
    shift = LK - L
    lo = 0
    if CAUSAL:  # query rows before the first key of this block see none of it
        lo = tl.maximum(0, pid_n * BLOCK_N - shift) // BLOCK_M * BLOCK_M

    f_site, f_bh, f_row, f_col, f_val, f_keep, f_mode, f_bit = load_fault(FAULT, INJECT)

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
        fresh = (attempt == 0) | (f_keep != 0)
        for g in range(GROUP):
            h = hk * GROUP + g
            bh = b * H + h
            here = f_bh == bh
            for start in range(lo, L, BLOCK_M):
                offs_m = start + tl.arange(0, BLOCK_M)
                row_ok = offs_m < L
                qm = row_ok[:, None] & d_ok[None, :]
                q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                            mask=qm, other=0.0)  # fmt: skip
                do = tl.load(
                    DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd,
                    mask=qm, other=0.0)  # fmt: skip
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=0.0)
                delta = tl.load(DELTA + bh * L + offs_m, mask=row_ok, other=0.0)
                # S^T (BLOCK_N, BLOCK_M)
                st = tl.dot(k, tl.trans(q))
                if INJECT:
                    hit = ((f_site == SITE_ST) & here & fresh & at(offs_n, f_col)[:, None]
                           & at(offs_m, f_row)[None, :])  # fmt: skip
                    st = corrupt(st, hit, f_val, f_mode, f_bit)
                if CHECK:
                    q_bar = tl.sum(q.to(tl.float32), 0)
                    q_abs = tl.sum(tl.abs(q).to(tl.float32), 0)
                    ref = tl.sum(k.to(tl.float32) * q_bar[None, :], 1)
                    bound = tl.sum(k_abs * q_abs[None, :], 1)
                    bad = ~(tl.abs(tl.sum(st, 1) - ref) <= tau * bound + TAU_ABS) & key_ok
                    if tl.sum(bad.to(tl.int32), 0) > 0:
                        tl.atomic_add(COUNTS + ST_CHECK * 3, 1)
                        st = tl.dot(k, tl.trans(q))
                        if INJECT:
                            again = (
                                (f_site == SITE_ST) & here & (f_keep != 0)
                                & at(offs_n, f_col)[:, None] & at(offs_m, f_row)[None, :]
                            )  # fmt: skip
                            st = corrupt(st, again, f_val, f_mode, f_bit)
                        bad = ~(tl.abs(tl.sum(st, 1) - ref) <= tau * bound + TAU_ABS) & key_ok
                        still = (tl.sum(bad.to(tl.int32), 0) > 0).to(tl.int32)
                        tl.atomic_add(COUNTS + ST_CHECK * 3 + 1 + still, 1)
                ok = tl.trans(_allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                                       CAUSAL, WINDOW, HAS_MASK))  # fmt: skip
                pt = tl.where(ok, tl.exp2(st * qk_scale - lse[None, :]), 0.0)
                pt_lo = pt.to(do.dtype)
                dv = tl.dot(pt_lo, do, dv)
                if INJECT:
                    hit = ((f_site == SITE_DV) & here & fresh & (start == lo)
                           & at(offs_n, f_row)[:, None] & at(offs_d, f_col)[None, :])  # fmt: skip
                    dv = corrupt(dv, hit, f_val, f_mode, f_bit)
                # dP^T (BLOCK_N, BLOCK_M)
                dpt = tl.dot(v, tl.trans(do))
                if INJECT:
                    hit = ((f_site == SITE_DPT) & here & fresh & at(offs_n, f_col)[:, None]
                           & at(offs_m, f_row)[None, :])  # fmt: skip
                    dpt = corrupt(dpt, hit, f_val, f_mode, f_bit)
                if CHECK:
                    do_bar = tl.sum(do.to(tl.float32), 0)
                    do_abs = tl.sum(tl.abs(do).to(tl.float32), 0)
                    ref = tl.sum(v.to(tl.float32) * do_bar[None, :], 1)
                    bound = tl.sum(v_abs * do_abs[None, :], 1)
                    bad = ~(tl.abs(tl.sum(dpt, 1) - ref) <= tau * bound + TAU_ABS) & key_ok
                    if tl.sum(bad.to(tl.int32), 0) > 0:
                        tl.atomic_add(COUNTS + DPT_CHECK * 3, 1)
                        dpt = tl.dot(v, tl.trans(do))
                        if INJECT:
                            again = (
                                (f_site == SITE_DPT) & here & (f_keep != 0)
                                & at(offs_n, f_col)[:, None] & at(offs_m, f_row)[None, :]
                            )  # fmt: skip
                            dpt = corrupt(dpt, again, f_val, f_mode, f_bit)
                        bad = ~(tl.abs(tl.sum(dpt, 1) - ref) <= tau * bound + TAU_ABS) & key_ok
                        still = (tl.sum(bad.to(tl.int32), 0) > 0).to(tl.int32)
                        tl.atomic_add(COUNTS + DPT_CHECK * 3 + 1 + still, 1)
                dst = pt * (dpt - delta[None, :])
                dst_lo = dst.to(q.dtype)
                dk = tl.dot(dst_lo, q, dk)
                if INJECT:
                    hit = ((f_site == SITE_DK) & here & fresh & (start == lo)
                           & at(offs_n, f_row)[:, None] & at(offs_d, f_col)[None, :])  # fmt: skip
                    dk = corrupt(dk, hit, f_val, f_mode, f_bit)
                if CHECK:
                    p32 = pt_lo.to(tl.float32)
                    c_dv += tl.sum(p32 * tl.sum(do.to(tl.float32), 1)[None, :], 1)
                    t_dv += tl.sum(p32 * tl.sum(tl.abs(do).to(tl.float32), 1)[None, :], 1)
                    ds32 = dst_lo.to(tl.float32)
                    c_dk += tl.sum(ds32 * tl.sum(q.to(tl.float32), 1)[None, :], 1)
                    t_dk += tl.sum(tl.abs(ds32) * tl.sum(tl.abs(q).to(tl.float32), 1)[None, :], 1)
        todo = 0
        if CHECK:
            n_dv = tl.sum((~(tl.abs(tl.sum(dv, 1) - c_dv) <= tau * t_dv + TAU_ABS)
                           & key_ok).to(tl.int32), 0)  # fmt: skip
            n_dk = tl.sum((~(tl.abs(tl.sum(dk, 1) - c_dk) <= tau * t_dk + TAU_ABS)
                           & key_ok).to(tl.int32), 0)  # fmt: skip
            if attempt == 0:
                first_dv = n_dv
                first_dk = n_dk
                if n_dv > 0:
                    tl.atomic_add(COUNTS + DV_CHECK * 3, 1)
                if n_dk > 0:
                    tl.atomic_add(COUNTS + DK_CHECK * 3, 1)
                if n_dv + n_dk > 0:
                    todo = 1
            else:
                if first_dv > 0:
                    tl.atomic_add(COUNTS + DV_CHECK * 3 + 1 + (n_dv > 0).to(tl.int32), 1)
                if first_dk > 0:
                    tl.atomic_add(COUNTS + DK_CHECK * 3 + 1 + (n_dk > 0).to(tl.int32), 1)
        attempt += 1

    out = b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    out = b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DELTA_ABS, DQ, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdb, sdh, sdm, sdd, smb,
    H, L, LK, D, GROUP, qk_scale, scale, window, tau, tau_out,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < D
    qm = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                mask=qm, other=0.0)  # fmt: skip
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :] * sdd,
                 mask=qm, other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh * L + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * L + offs_m, mask=row_ok, other=0.0)
    delta_abs = tl.load(DELTA_ABS + bh * L + offs_m, mask=row_ok, other=0.0)
    shift = LK - L
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, (pid_m * BLOCK_M + shift - window + 1) // BLOCK_N * BLOCK_N)

    f_site, f_bh, f_row, f_col, f_val, f_keep, f_mode, f_bit = load_fault(FAULT, INJECT)
    here = f_bh == bh

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
        fresh = (attempt == 0) | (f_keep != 0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            kv_mask = (offs_n < LK)[:, None] & d_ok[None, :]
            k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                        mask=kv_mask, other=0.0)  # fmt: skip
            v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
                        mask=kv_mask, other=0.0)  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k))
            if INJECT:
                hit = ((f_site == SITE_SQ) & here & fresh & at(offs_m, f_row)[:, None]
                       & at(offs_n, f_col)[None, :])  # fmt: skip
                s = corrupt(s, hit, f_val, f_mode, f_bit)
            ok = _allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb,
                          CAUSAL, WINDOW, HAS_MASK)  # fmt: skip
            p = tl.where(ok, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            if INJECT:
                hit = ((f_site == SITE_DP) & here & fresh & at(offs_m, f_row)[:, None]
                       & at(offs_n, f_col)[None, :])  # fmt: skip
                dp = corrupt(dp, hit, f_val, f_mode, f_bit)
            ds = p * (dp - delta[:, None])
            ds_lo = ds.to(k.dtype)
            dq = tl.dot(ds_lo, k, dq)
            if INJECT:
                hit = ((f_site == SITE_DQ) & here & fresh & (start == lo)
                       & at(offs_m, f_row)[:, None] & at(offs_d, f_col)[None, :])  # fmt: skip
                dq = corrupt(dq, hit, f_val, f_mode, f_bit)
            if CHECK:
                p_sum += tl.sum(p, 1)
                ds_sum += tl.sum(ds, 1)
                ds_mag += tl.sum(tl.abs(p * dp), 1)
                n_valid += tl.sum(ok.to(tl.float32), 1)
                ds32 = ds_lo.to(tl.float32)
                c_dq += tl.sum(ds32 * tl.sum(k.to(tl.float32), 1)[None, :], 1)
                t_dq += tl.sum(tl.abs(ds32) * tl.sum(tl.abs(k).to(tl.float32), 1)[None, :], 1)
        todo = 0
        if CHECK:
            any_key = n_valid > 0
            bad_p = any_key & ~(tl.abs(p_sum - 1.0) <= TAU_P)
            # Delta comes from O as stored (rounded to its dtype): tau_out sum_d |dO O| of it
            tol_ds = tau * (ds_mag + tl.abs(delta)) + tau_out * delta_abs + TAU_ABS
            bad_ds = any_key & ~(tl.abs(ds_sum) <= tol_ds)
            bad_dq = row_ok & ~(tl.abs(tl.sum(dq, 1) - c_dq) <= tau * t_dq + TAU_ABS)
            n_p = tl.sum(bad_p.to(tl.int32), 0)
            n_ds = tl.sum(bad_ds.to(tl.int32), 0)
            n_dq = tl.sum(bad_dq.to(tl.int32), 0)
            code = (
                (n_p > 0).to(tl.int32) + 2 * (n_ds > 0).to(tl.int32) + 4 * (n_dq > 0).to(tl.int32)
            )
            if attempt == 0:
                first = code
                if n_p > 0:
                    tl.atomic_add(COUNTS + P_SUM * 3, 1)
                if n_ds > 0:
                    tl.atomic_add(COUNTS + DS_SUM * 3, 1)
                if n_dq > 0:
                    tl.atomic_add(COUNTS + DQ_CHECK * 3, 1)
                if code > 0:
                    todo = 1
            else:
                if first % 2 == 1:
                    tl.atomic_add(COUNTS + P_SUM * 3 + 1 + (n_p > 0).to(tl.int32), 1)
                if (first // 2) % 2 == 1:
                    tl.atomic_add(COUNTS + DS_SUM * 3 + 1 + (n_ds > 0).to(tl.int32), 1)
                if first // 4 == 1:
                    tl.atomic_add(COUNTS + DQ_CHECK * 3 + 1 + (n_dq > 0).to(tl.int32), 1)
        attempt += 1

    tl.store(DQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
             (dq * scale).to(DQ.dtype.element_ty), mask=qm)  # fmt: skip
