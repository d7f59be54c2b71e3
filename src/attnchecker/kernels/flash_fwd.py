"""The checked flash attention forward: a Triton kernel that detects and corrects in place.

One program owns a block of BLOCK_M query rows of one (batch, head) and streams the key/value
tiles of BLOCK_N keys (online softmax in base 2, as FlashAttention-2), with three checks
(``../shared/spec/fused-attention.md`` section 3.2):

- **S tile** S = Q K_n^T: column sums against q-bar . k_j (q-bar = sum of the program's query
  rows, computed once), bound |q|-bar . |k_j|; the only check that sees a finite near-INF
  logit. Columns, not rows: the references need two (BLOCK_D,) vectors of Q, not a |Q| tile
  kept live across the loop (registers). A failing tile is recomputed at once from Q and K
  re-read from memory (volatile loads: the compiler cannot merge the second GEMM with the
  first) and checked again; failing twice it is reported uncorrected.
- **PV accumulator**, deferred: c_i <- alpha_i c_i + sum_j p~_ij v-bar_j and t_i <- alpha_i t_i +
  sum_j p~_ij |v|-bar_j carried through the online rescaling (p~ = p as it enters the MMA, so
  t is an exact bound since p >= 0); after the loop sum_d acc_id must equal c_i within tau t_i.
  It covers the PV MMA, every rescale and the accumulation.
- **Softmax range**, free: after the loop 1 <= l_i <= (valid keys of row i)(1 + eps) and l_i
  finite (a fault that reaches the softmax as a positive or non-finite value breaks it).

A deferred failure re-runs the program's whole loop once (the inputs are read-only, so a re-run
is idempotent); a second failure is reported uncorrected. Counters (detected, corrected,
uncorrected per check) are atomically added on the device: no host synchronisation.

Tolerances, relative to the absolute-value bound beta with the absolute floor TAU_ABS:
``tau`` for the tile check (reduction d, BLOCK_M rows summed), ``tau_acc`` for the deferred
check and the softmax range (reduction over the keys); both derived by the launcher from one
model (:func:`attnchecker.abft.tolerance.kernel_factor`: fp32 accumulation, TF32 operands
where fp32 runs on TF32 MMAs) times the config's ``tolerance_scale``. INF, NaN and near-INF
(>= 1e10) faults are 6+ orders of magnitude past them.

Offsets: the batch, head and tile-start terms are 64-bit (a Q / K / V tensor may hold more
than 2^31 elements); only in-tile offsets are 32-bit.

Fault injection (tests, campaigns; ``common.inject``): site ``s`` replaces S[row, col] of the
tile holding key col, site ``pv`` the PV accumulator element (row, col = feature) after the
first tile's MMA. A transient fault hits the first computation only; a persistent one every
recomputation too.
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

_S, _PV, _SM = row("s"), row("pv"), row("softmax")
SITE_S, SITE_PV = site("s"), site("pv")


@triton.jit
def _fwd(
    Q, K, V, Out, LSE, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, smb,
    H, L, LK, D, GROUP, qk_scale, window, tau, tau_acc,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_S: tl.constexpr, CHECK_PV: tl.constexpr, CHECK_SM: tl.constexpr,
    INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP  # the K/V head of this query head (GQA / MQA)
    row0 = pid_m * BLOCK_M
    rows = tl.arange(0, BLOCK_M)  # in-tile offsets
    cols = tl.arange(0, BLOCK_N)
    offs_m = row0 + rows
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < L
    d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_at = Q + b * sqb + h * sqh + tl.cast(row0, tl.int64) * sqm
    k_at = K + b * skb + hk * skh
    v_at = V + b * svb + hk * svh
    q = tile(q_at, rows, sqm, offs_d, sqd, q_mask, UPCAST, False)
    q32 = q.to(tl.float32)
    q_bar = tl.sum(q32, 0)  # (BLOCK_D,): the S check's references need only these
    q_mag = tl.sum(tl.abs(q32), 0)
    shift = LK - L  # query i sits at key position i + shift (a KV cache makes LK > L)
    hi = LK
    if CAUSAL:
        hi = tl.minimum(LK, row0 + BLOCK_M + shift)
    lo = 0
    if WINDOW:
        lo = tl.maximum(0, (row0 + shift - window + 1) // BLOCK_N * BLOCK_N)

    fault = load_fault(FAULT, INJECT)
    CHECK_DEFERRED: tl.constexpr = CHECK_PV or CHECK_SM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    c_i = tl.zeros([BLOCK_M], tl.float32)
    t_i = tl.zeros([BLOCK_M], tl.float32)
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
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + cols
            key_ok = offs_n < LK
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k_tile = k_at + tl.cast(start, tl.int64) * skn
            k = tile(k_tile, cols, skn, offs_d, skd, kv_mask, UPCAST, False)
            v = tile(v_at + tl.cast(start, tl.int64) * svn, cols, svn, offs_d, svd, kv_mask, UPCAST,
                     False)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=DOT)  # (BLOCK_M, BLOCK_N) fp32
            if INJECT:
                s = inject(s, fault, SITE_S, bh, offs_m, offs_n, attempt, True)
            if CHECK_S and tile_check(s, q_bar, q_mag, k, key_ok, tau) > 0:
                count(COUNTS, _S, 0)  # recompute the tile from fresh loads, check again
                s = fresh_product(q_at, rows, sqm, q_mask, k_tile, cols, skn, kv_mask, offs_d, sqd,
                                  skd, UPCAST, DOT)  # fmt: skip
                if INJECT:
                    s = inject(s, fault, SITE_S, bh, offs_m, offs_n, 1, True)
                still = tile_check(s, q_bar, q_mag, k, key_ok, tau) > 0
                count(COUNTS, _S, 1 + still.to(tl.int32))
            valid = allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb, CAUSAL, WINDOW,
                            HAS_MASK)  # fmt: skip
            z = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(z - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            p_lo = p.to(v.dtype)  # what enters the MMA
            acc = tl.dot(p_lo, v, acc * alpha[:, None], input_precision=DOT)
            if INJECT:
                acc = inject(acc, fault, SITE_PV, bh, offs_m, offs_d, attempt, start == lo)
            if CHECK_PV:
                p32 = p_lo.to(tl.float32)
                v32 = v.to(tl.float32)
                c_i = c_i * alpha + tl.sum(p32 * tl.sum(v32, 1)[None, :], 1)
                t_i = t_i * alpha + tl.sum(p32 * tl.sum(tl.abs(v32), 1)[None, :], 1)
            m_i = m_new
        todo = 0
        if CHECK_DEFERRED:
            n_pv = 0
            n_sm = 0
            if CHECK_PV:
                n_pv = tl.sum((fails(tl.sum(acc, 1) - c_i, tau_acc * t_i + TAU_ABS) & row_ok)
                              .to(tl.int32), 0)  # fmt: skip
            if CHECK_SM:  # rows with a key (m_i finite or NaN): 1 <= l_i <= keys swept
                in_range = (l_i >= 1.0 - tau_acc) & (l_i <= (hi - lo) * (1.0 + tau_acc))
                n_sm = tl.sum((~(m_i == float("-inf")) & ~in_range & row_ok).to(tl.int32), 0)
            if attempt == 0:
                first_pv = n_pv
                first_sm = n_sm
                if n_pv > 0:
                    count(COUNTS, _PV, 0)
                if n_sm > 0:
                    count(COUNTS, _SM, 0)
                if n_pv + n_sm > 0:
                    todo = 1  # re-run the loop once
            else:  # the re-run: corrected, or still failing (uncorrected)
                if first_pv > 0:
                    count(COUNTS, _PV, 1 + (n_pv > 0).to(tl.int32))
                if first_sm > 0:
                    count(COUNTS, _SM, 1 + (n_sm > 0).to(tl.int32))
        attempt += 1

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_at = Out + b * sob + h * soh + tl.cast(row0, tl.int64) * som
    tl.store(o_at + rows[:, None] * som + offs_d[None, :] * sod, out.to(Out.dtype.element_ty),
             mask=q_mask)  # fmt: skip
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), 0.0)  # base 2; rows with no key: 0
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)
