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
    accumulate,
    allowed,
    carry,
    checked_product,
    key_range,
    load_fault,
    off_rows,
    program_block,
    row,
    site,
    sums,
    tally,
    tile,
)  # fmt: skip

_S, _PV, _SM = row("s"), row("pv"), row("softmax")
SITE_S, SITE_PV = site("s"), site("pv")


@triton.jit
def fwd_kernel(
    Q, K, V, Out, LSE, KMASK, COUNTS, FAULT,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, smb,
    H, L, LK, D, GROUP, qk_scale, window, tau, tau_acc,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, HAS_MASK: tl.constexpr, UPCAST: tl.constexpr,
    CHECK_S: tl.constexpr, CHECK_PV: tl.constexpr, CHECK_SM: tl.constexpr,
    INJECT: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bh, b, h, row0, offs_m, offs_d, row_ok, d_ok, q_mask = program_block(H, L, D, BLOCK_M, BLOCK_D)
    hk = h // GROUP  # the K/V head of this query head (GQA / MQA)
    rows = tl.arange(0, BLOCK_M)  # in-tile offsets
    cols = tl.arange(0, BLOCK_N)
    q_at = Q + b * sqb + h * sqh + tl.cast(row0, tl.int64) * sqm
    k_at = K + b * skb + hk * skh
    v_at = V + b * svb + hk * svh
    q = tile(q_at, rows, sqm, offs_d, sqd, q_mask, UPCAST, False)  # (BLOCK_M, BLOCK_D)
    q_bar, q_mag = sums(q)  # (BLOCK_D,) each: the S check's references need only these
    shift, lo, hi = key_range(row0, L, LK, window, CAUSAL, WINDOW, BLOCK_M, BLOCK_N)

    fault = load_fault(FAULT, INJECT)
    CHECK_DEFERRED: tl.constexpr = CHECK_PV or CHECK_SM
    # read after the loop, so defined before it (Triton); each attempt restarts them
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = tl.full([], 0, tl.int32)  # the deferred checks that failed at attempt 0 (bits)
    attempt = 0
    todo = 1
    while todo > 0:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of its exponentials
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        c_i = tl.zeros([BLOCK_M], tl.float32)  # the PV check's checksum and bound
        t_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + cols
            key_ok = offs_n < LK
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k_tile = k_at + tl.cast(start, tl.int64) * skn
            k = tile(k_tile, cols, skn, offs_d, skd, kv_mask, UPCAST, False)
            v = tile(v_at + tl.cast(start, tl.int64) * svn, cols, svn, offs_d, svd, kv_mask, UPCAST,
                     False)  # fmt: skip
            # S (BLOCK_M, BLOCK_N) fp32, checked (and recomputed) by key columns
            s = checked_product(q, k, (q_at, rows, sqm, offs_d, sqd, q_mask),
                                (k_tile, cols, skn, offs_d, skd, kv_mask), q_bar, q_mag, key_ok,
                                tau, fault, SITE_S, bh, offs_m, offs_n, attempt, COUNTS, _S,
                                CHECK_S, INJECT, UPCAST, DOT)  # fmt: skip
            valid = allowed(offs_m, offs_n, L, LK, shift, window, KMASK, b, smb, CAUSAL, WINDOW,
                            HAS_MASK)  # fmt: skip
            z = tl.where(valid, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(z, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(z - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            p_lo = p.to(v.dtype)  # what enters the MMA
            acc = accumulate(p_lo, v, acc * alpha[:, None], fault, SITE_PV, bh, offs_m, offs_d,
                             attempt, start == lo, INJECT, DOT)  # fmt: skip
            if CHECK_PV:  # p >= 0: p is its own magnitude
                p32 = p_lo.to(tl.float32)
                c_i, t_i = carry(c_i * alpha, t_i * alpha, p32, p32, v)
            m_i = m_new
        todo = 0
        if CHECK_DEFERRED:
            n_pv = 0
            n_sm = 0
            if CHECK_PV:
                n_pv = off_rows(acc, c_i, t_i, tau_acc, row_ok)
            if CHECK_SM:  # rows with a key (m_i finite or NaN): 1 <= l_i <= keys swept
                in_range = (l_i >= 1.0 - tau_acc) & (l_i <= (hi - lo) * (1.0 + tau_acc))
                n_sm = tl.sum((~(m_i == float("-inf")) & ~in_range & row_ok).to(tl.int32), 0)
            first, todo = tally(COUNTS, (_PV, _SM), (n_pv, n_sm), attempt, first)
        attempt += 1

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_at = Out + b * sob + h * soh + tl.cast(row0, tl.int64) * som
    tl.store(o_at + rows[:, None] * som + offs_d[None, :] * sod, out.to(Out.dtype.element_ty),
             mask=q_mask)  # fmt: skip
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), 0.0)  # base 2; rows with no key: 0
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)
