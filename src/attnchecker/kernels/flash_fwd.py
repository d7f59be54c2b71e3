"""The checked flash attention forward: a Triton kernel that detects and corrects in place.

One program owns a block of BLOCK_M query rows of one (batch, head) and streams the key/value
tiles of BLOCK_N keys (online softmax in base 2, as FlashAttention-2), with three checks
(``../shared/spec/fused-attention.md`` section 3.2):

- **S tile** S = Q K_n^T: row sums against q_i . k-bar_n (k-bar_n = sum of the tile's keys),
  bound |q_i| . |k|-bar_n; the only check that sees a finite near-INF logit. A failing tile is
  recomputed at once and checked again; failing twice it is reported uncorrected.
- **PV accumulator**, deferred: c_i <- alpha_i c_i + sum_j p~_ij v-bar_j and t_i <- alpha_i t_i +
  sum_j p~_ij |v|-bar_j carried through the online rescaling (p~ = p as it enters the MMA, so
  t is an exact bound since p >= 0); after the loop sum_d acc_id must equal c_i within tau t_i.
  It covers the PV MMA, every rescale and the accumulation.
- **Softmax range**, free: after the loop 1 <= l_i <= (valid keys of row i)(1 + eps) and l_i
  finite (a fault that reaches the softmax as a positive or non-finite value breaks it).

A deferred failure re-runs the program's whole loop once (the inputs are read-only, so a re-run
is idempotent); a second failure is reported uncorrected. Counters (detected, corrected,
uncorrected per check) are atomically added on the device: no host synchronisation.

Tolerances, relative to the absolute-value bound beta with an absolute floor TAU_ABS:
fp16 / bf16 operands have exact products in fp32, so a row sum of K terms carries about
(K + BLOCK) 2^-24 beta of accumulation error: tau = 1e-4 leaves a 10x margin at K = 128. fp32
operands may run through TF32 MMAs on a GPU (10-bit mantissas against a full fp32
prediction): about 2^-11 beta, tau = 4e-3. The floor 1e-30 covers subnormal P (a measured
false-alarm trap) and flush-to-zero. INF, NaN and near-INF (>= 1e10) faults are 6+ orders of
magnitude past either.

Fault injection (tests, campaigns): FAULT holds (site, batch * head, row, col, value,
persistent); site 1 replaces S[row, col] of the tile holding key col, site 2 the PV
accumulator element (row, col = feature) after the first tile's MMA. A transient fault hits the
first computation only; a persistent one every recomputation too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from attnchecker.kernels.common import at, corrupt, load_fault

S_CHECK, PV_CHECK, SOFTMAX_CHECK = 0, 1, 2  # rows of the counters
SITE_S, SITE_PV = 1, 2  # fault sites
TAU_ABS = 1e-30


@triton.jit
def _fwd(
    Q, K, V, Out, LSE, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, smb,
    H, L, LK, D, GROUP, qk_scale, window, tau,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK: tl.constexpr, INJECT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP  # the K/V head of this query head (GQA / MQA)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < D
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )  # fmt: skip
    if UPCAST:  # the interpreter cannot compute in bf16: fp32 operands
        q = q.to(tl.float32)
    q_abs = tl.abs(q).to(tl.float32)
    shift = LK - L  # query i sits at key position i + shift (a KV cache makes LK > L)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, (pid_m * BLOCK_M + shift - window + 1) // BLOCK_N * BLOCK_N)

    f_site, f_bh, f_row, f_col, f_val, f_keep, f_mode, f_bit = load_fault(FAULT, INJECT)
    here = f_bh == bh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
    n_valid = tl.zeros([BLOCK_M], tl.float32)
    first_pv = tl.full([], 0, tl.int32)  # rows that failed each deferred check at attempt 0
    first_sm = tl.full([], 0, tl.int32)
    attempt = 0
    todo = 1
    while todo > 0:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        c_i = tl.zeros([BLOCK_M], tl.float32)
        t_i = tl.zeros([BLOCK_M], tl.float32)
        n_valid = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            key_ok = offs_n < LK
            kv_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(
                K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :] * skd,
                mask=kv_ok, other=0.0,
            )  # fmt: skip
            v = tl.load(
                V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
                mask=kv_ok, other=0.0,
            )  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N) fp32
            if INJECT:
                hit = (
                    (f_site == SITE_S) & here
                    & at(offs_m, f_row)[:, None] & at(offs_n, f_col)[None, :]
                    & ((attempt == 0) | (f_keep != 0))
                )  # fmt: skip
                s = corrupt(s, hit, f_val, f_mode, f_bit)
            if CHECK:
                k_bar = tl.sum(k.to(tl.float32), 0)  # (BLOCK_D,)
                k_abs = tl.sum(tl.abs(k).to(tl.float32), 0)
                ref = tl.sum(q.to(tl.float32) * k_bar[None, :], 1)
                bound = tl.sum(q_abs * k_abs[None, :], 1)
                bad = ~(tl.abs(tl.sum(s, 1) - ref) <= tau * bound + TAU_ABS) & row_ok
                n_bad = tl.sum(bad.to(tl.int32), 0)
                if n_bad > 0:  # recompute the tile and check it again
                    tl.atomic_add(COUNTS + S_CHECK * 3, 1)
                    s = tl.dot(q, tl.trans(k))
                    if INJECT:
                        again = (
                            (f_site == SITE_S) & here & (f_keep != 0)
                            & at(offs_m, f_row)[:, None] & at(offs_n, f_col)[None, :]
                        )  # fmt: skip
                        s = corrupt(s, again, f_val, f_mode, f_bit)
                    bad = ~(tl.abs(tl.sum(s, 1) - ref) <= tau * bound + TAU_ABS) & row_ok
                    still = tl.sum(bad.to(tl.int32), 0) > 0
                    tl.atomic_add(COUNTS + S_CHECK * 3 + 1 + still.to(tl.int32), 1)
            valid = row_ok[:, None] & key_ok[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None] + shift)
            if WINDOW:
                valid = valid & (offs_n[None, :] > offs_m[:, None] + shift - window)
            if HAS_MASK:
                keep = tl.load(KMASK + b * smb + offs_n, mask=key_ok, other=0)
                valid = valid & (keep[None, :] != 0)
            z = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(z - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            p_lo = p.to(v.dtype)  # what enters the MMA
            acc = tl.dot(p_lo, v, acc * alpha[:, None])
            if INJECT:
                hit = (
                    (f_site == SITE_PV) & here & (start == lo)
                    & at(offs_m, f_row)[:, None] & at(offs_d, f_col)[None, :]
                    & ((attempt == 0) | (f_keep != 0))
                )  # fmt: skip
                acc = corrupt(acc, hit, f_val, f_mode, f_bit)
            if CHECK:
                p32 = p_lo.to(tl.float32)
                v_bar = tl.sum(v.to(tl.float32), 1)  # (BLOCK_N,)
                v_abs = tl.sum(tl.abs(v).to(tl.float32), 1)
                c_i = c_i * alpha + tl.sum(p32 * v_bar[None, :], 1)
                t_i = t_i * alpha + tl.sum(p32 * v_abs[None, :], 1)
                n_valid += tl.sum(valid.to(tl.float32), 1)
            m_i = m_new
        todo = 0
        if CHECK:
            pv_bad = ~(tl.abs(tl.sum(acc, 1) - c_i) <= tau * t_i + TAU_ABS) & row_ok
            any_key = n_valid > 0
            sm_bad = any_key & ~((l_i >= 1.0 - tau) & (l_i <= n_valid * (1.0 + tau)))
            n_pv = tl.sum(pv_bad.to(tl.int32), 0)
            n_sm = tl.sum(sm_bad.to(tl.int32), 0)
            if attempt == 0:
                first_pv = n_pv
                first_sm = n_sm
                if n_pv > 0:
                    tl.atomic_add(COUNTS + PV_CHECK * 3, 1)
                if n_sm > 0:
                    tl.atomic_add(COUNTS + SOFTMAX_CHECK * 3, 1)
                if n_pv + n_sm > 0:
                    todo = 1  # re-run the loop once
            else:  # the re-run: corrected, or still failing (uncorrected)
                if first_pv > 0:
                    tl.atomic_add(COUNTS + PV_CHECK * 3 + 1 + (n_pv > 0).to(tl.int32), 1)
                if first_sm > 0:
                    tl.atomic_add(COUNTS + SOFTMAX_CHECK * 3 + 1 + (n_sm > 0).to(tl.int32), 1)
        attempt += 1

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
        out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )  # fmt: skip
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), 0.0)  # base 2; rows with no key: 0
    tl.store(LSE + bh * L + offs_m, lse, mask=row_ok)
