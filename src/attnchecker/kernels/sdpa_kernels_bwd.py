"""The SDPA route's backward checks as Triton kernels (the forward's:
:mod:`attnchecker.kernels.sdpa_kernels`; the shared helpers:
:mod:`~attnchecker.kernels.triton_utils`), five launches a layer in three ops, none waiting for
the host, every grid as wide as its data:

- ``bwd_q_kernel`` (op ``bwd_verify``): per block of query rows, dQ's bound and the partial sums
  the dV and dK checks compare with (sum live_i dO_i, its tolerance, sum a_i |q_i|);
- ``bwd_kv_kernel`` (op ``bwd_sums``): per block of key rows, the column sums of dK and dV;
- ``bwd_check_kernel``, ``bwd_repair_q_kernel`` and ``bwd_repair_kv_kernel`` (op
  ``bwd_repair``): per (K/V head group, 16 columns), the partials reduced in vector loads and
  dK's and dV's checks; per (block of query rows, query head) and per (block of key rows, K/V
  group), one vector load of the group's result and a return on a clean group, else the
  block's dQ, or dK's and dV's block, recomputed (FlashAttention-2's backward from the saved
  LSE: P = exp(s - LSE), dS = P (dP - D)) and checked again (two kernels: together in one,
  the fp32 recomputations spilled).

Records: dQ's rows and columns summed over flagged blocks (value 0), dK's and dV's a row a
flagged group, columns summed, the value of the first flagged group's largest flagged sum;
written by one program a record, elected by group order, so nothing depends on which program
runs first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.tolerance import underflow_floor
from attnchecker.kernels import DEAD, SDPA_BLOCKS, sdpa_check
from attnchecker.kernels.launches import host_flag
from attnchecker.kernels.sdpa_check import SdpaOps, define, reduce_stats
from attnchecker.kernels.sdpa_kernels import fwd_repair_op, fwd_verify_op, kv_stats_op
from attnchecker.kernels.triton_utils import (
    EPS32,
    EPS32_K,
    add_record,
    block_d,
    block_scores,
    dot,
    head_stats,
    mark_lost,
    mask_view,
    popcount16,
    readable,
    row_view,
    tile,
    use_ieee,
)

__all__ = ["bwd_cols", "bwd_repair", "bwd_rows"]

_F32 = torch.float32
_BM, _BN = SDPA_BLOCKS[1:]
_DEAD = tl.constexpr(DEAD)
_DC = 16  # columns a program of the group check
_ENTRY = tl.constexpr(6)  # int32s of a group check's entry


@triton.jit
def bwd_q_kernel(Q, DO, LSE, DQ, STATS, RMX, PART, FLAGS, H, rep, L, Lk, d, S, nM,
                 sq_b, sq_h, sq_l, sq_d, sg_b, sg_h, sg_l, sg_d, sl_b, sl_h, sl_l,
                 sd_b, sd_h, sd_l, sd_d, sr_b, sr_h, sr_l, scale_abs, w_live, c_q, floor_q,
                 drop_c, BM: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    pm, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    ds = tl.arange(0, BD)
    dm = ds < d
    _, _, ka, _, va = head_stats(STATS, b * (H // rep) + h // rep, S, d, ds, dm)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rm = rows < L
    g = tile(DO + b * sg_b + h * sg_h, rows, ds, sg_l, sg_d, rm, dm).to(tl.float32)
    q = tile(Q + b * sq_b + h * sq_h, rows, ds, sq_l, sq_d, rm, dm).to(tl.float32)
    dq = tile(DQ + b * sd_b + h * sd_h, rows, ds, sd_l, sd_d, rm, dm).to(tl.float32)
    lse = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_l, mask=rm, other=0.0)
    rmx = tl.load(RMX + b * sr_b + h * sr_h + rows * sr_l, mask=rm, other=_DEAD)
    live = rmx > _DEAD
    lse_abs = tl.where(live & (tl.abs(lse) < float("inf")), tl.abs(lse), 0.0)
    a = drop_c * tl.sum(tl.abs(g), 1) * va * tl.where(live, 1.0, Lk * 1.0)
    bound = c_q * 2 * scale_abs * a[:, None] * ka[None, :] + floor_q
    q_bad = ~(tl.abs(dq) - bound <= 0.0) & rm[:, None] & dm[None, :]
    w = tl.where(live, w_live + EPS32_K * lse_abs, Lk * 1.0)
    w = tl.where(rm, w, 0.0)
    at = PART + (bh.to(tl.int64) * nM + pm) * (4 * d + 1)
    tl.store(at + ds, tl.sum(tl.where(live[:, None], g, 0.0), 0), mask=dm)
    tl.store(at + d + ds, tl.sum(w[:, None] * tl.abs(g), 0), mask=dm)
    tl.store(at + 2 * d + ds, tl.sum(a[:, None] * tl.abs(q), 0), mask=dm)
    tl.store(at + 3 * d, tl.max(lse_abs, 0))
    tl.store(at + 3 * d + 1 + ds, tl.sum(tl.where(live[:, None], tl.abs(g), 0.0), 0), mask=dm)
    n_q = tl.sum(tl.max(q_bad.to(tl.int32), 1), 0)
    tl.store(FLAGS + 2 * (bh.to(tl.int64) * nM + pm), n_q)
    cols = tl.max(q_bad.to(tl.int32), 0)
    tl.store(FLAGS + 2 * (bh.to(tl.int64) * nM + pm) + 1, tl.sum(cols, 0))
    if (pm == 0) & (bh == 0):  # the records' claims, for the repair
        claims = FLAGS + 2 * tl.num_programs(1).to(tl.int64) * nM + tl.arange(0, 8)
        tl.store(claims, tl.zeros([8], dtype=tl.int32))


@triton.jit
def bwd_kv_kernel(DK, DV, PART, Hkv, Lk, d, nN, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                  BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    pn, bkv = tl.program_id(0), tl.program_id(1)
    b, h = (bkv // Hkv).to(tl.int64), (bkv % Hkv).to(tl.int64)
    ds = tl.arange(0, BD)
    dm = ds < d
    rows = (pn * BN + tl.arange(0, BN)).to(tl.int64)
    rm = rows < Lk
    dk = tile(DK + b * sk_b + h * sk_h, rows, ds, sk_l, sk_d, rm, dm).to(tl.float32)
    dv = tile(DV + b * sv_b + h * sv_h, rows, ds, sv_l, sv_d, rm, dm).to(tl.float32)
    at = PART + (bkv.to(tl.int64) * nN + pn) * (2 * d)
    tl.store(at + ds, tl.sum(dk, 0), mask=dm)
    tl.store(at + d + ds, tl.sum(dv, 0), mask=dm)


@triton.jit
def _sums_bad(ref, tv, qa, lm, sk, sv, dm, scale_abs, c_k, tol, floor_k, floor_v, drop_c, ga,
              DROP: tl.constexpr):  # fmt: skip
    """(dK's flagged columns, dV's) of a group; ``DROP``: attention dropout, dV's sum in
    ``drop_c`` times [sum of the negative dO, of the positive] (``ga``: sum |dO|)."""
    t_k = tol * 4 * ((c_k + EPS32_K * lm) * scale_abs * 2 * qa + floor_k)
    t_v = tol * 4 * (tv * drop_c + floor_v)
    k_bad = ~(tl.abs(sk) - t_k <= 0.0) & dm
    if DROP:
        exc = tl.maximum(sv - drop_c * (ref + ga) * 0.5, drop_c * (ref - ga) * 0.5 - sv)
        v_bad = ~(exc - t_v <= 0.0) & dm
    else:
        v_bad = ~(tl.abs(sv - ref) - t_v <= 0.0) & dm
    return k_bad, v_bad


@triton.jit
def _col_sums(P, n, width, off, cols, cm, BJ: tl.constexpr, DC: tl.constexpr):
    """Columns ``cols`` of the n partials of P (``width`` floats apart, at ``off``) summed."""
    acc = tl.zeros([DC], dtype=tl.float32)
    for j0 in range(0, n, BJ):
        js = (j0 + tl.arange(0, BJ)).to(tl.int64)
        acc += tl.sum(tl.load(P + js[:, None] * width + off + cols[None, :],
                              mask=(js < n)[:, None] & cm[None, :], other=0.0), 0)  # fmt: skip
    return acc


@triton.jit
def bwd_check_kernel(QP, KVP, FLAGS, GRP, SCR, rep, d, nM, nN, scale_abs, c_k, tol, floor_k,
                     floor_v, drop_c, BJ: tl.constexpr, DC: tl.constexpr,
                     DROP: tl.constexpr):  # fmt: skip
    """Per (K/V head group, DC columns): the group's partials reduced in vector loads (no
    serial loop over flags), dK's and dV's column checks; into GRP the reduced reference sums
    (ref, tol_v, qa: 3 d floats, and max |LSE|) for the repair's re-check, into SCR the
    chunk's entry (:data:`_ENTRY` int32s: flagged dK and dV columns, the largest flagged sum of
    each (fp32 bits), the group's flagged dQ rows and columns (chunk 0)) and, from chunk 0,
    the group's arrival counter zeroed."""
    g, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    nC = tl.num_programs(1)
    cols = (c * DC + tl.arange(0, DC)).to(tl.int64)
    cm = cols < d
    W = 4 * d + 1
    heads = QP + g * rep * nM * W  # the group's rep heads' partials are consecutive
    ref = _col_sums(heads, rep * nM, W, 0, cols, cm, BJ, DC)
    tv = _col_sums(heads, rep * nM, W, d, cols, cm, BJ, DC)
    qa = _col_sums(heads, rep * nM, W, 2 * d, cols, cm, BJ, DC)
    sk = _col_sums(KVP + g * nN * 2 * d, nN, 2 * d, 0, cols, cm, BJ, DC)
    sv = _col_sums(KVP + g * nN * 2 * d, nN, 2 * d, d, cols, cm, BJ, DC)
    lm = tl.zeros([], dtype=tl.float32)
    n_q = tl.zeros([], dtype=tl.int32)
    c_q = tl.zeros([], dtype=tl.int32)
    for j0 in range(0, rep * nM, BJ):
        js = (j0 + tl.arange(0, BJ)).to(tl.int64)
        jm = js < rep * nM
        lm = tl.maximum(lm, tl.max(tl.load(heads + js * W + 3 * d, mask=jm, other=0.0), 0))
        fl = FLAGS + 2 * (g * rep * nM + js)
        n_q += tl.sum(tl.load(fl, mask=jm, other=0), 0)
        c_q += tl.sum(tl.load(fl + 1, mask=jm, other=0), 0)
    ga = ref
    if DROP:
        ga = _col_sums(heads, rep * nM, W, 3 * d + 1, cols, cm, BJ, DC)
    k_bad, v_bad = _sums_bad(ref, tv, qa, lm, sk, sv, cm, scale_abs, c_k, tol, floor_k, floor_v,
                             drop_c, ga, DROP)  # fmt: skip
    at = GRP + g * (3 * d + 1)
    tl.store(at + cols, ref, mask=cm)
    tl.store(at + d + cols, tv, mask=cm)
    tl.store(at + 2 * d + cols, qa, mask=cm)
    e = SCR + (g * nC + c) * _ENTRY
    tl.store(e, tl.sum(k_bad.to(tl.int32) << tl.arange(0, DC), 0))  # DC = 16: one word
    tl.store(e + 1, tl.sum(v_bad.to(tl.int32) << tl.arange(0, DC), 0))
    tl.store(e + 2, tl.max(tl.where(k_bad, sk, 0.0), 0).to(tl.int32, bitcast=True))
    tl.store(e + 3, tl.max(tl.where(v_bad, sv, 0.0), 0).to(tl.int32, bitcast=True))
    tl.store(e + 4, tl.where(c == 0, n_q, 0))
    tl.store(e + 5, tl.where(c == 0, c_q, 0))
    if c == 0:
        tl.store(at + 3 * d, lm)
        tl.store(SCR + tl.num_programs(0).to(tl.int64) * nC * _ENTRY + g, 0)  # the counter


@triton.jit
def _entries(SCR, g, nC, NC: tl.constexpr):
    """A group's chunk entries: (dK's flagged columns, dV's: (NC,) 16-bit words; dQ's flagged
    rows, columns; the largest flagged dK sum, dV's)."""
    cs = tl.arange(0, NC)
    at = SCR + (g * nC + cs) * _ENTRY
    cm = cs < nC
    wk = tl.load(at, mask=cm, other=0)
    wv = tl.load(at + 1, mask=cm, other=0)
    vk = tl.load(at + 2, mask=cm, other=0).to(tl.float32, bitcast=True)
    vv = tl.load(at + 3, mask=cm, other=0).to(tl.float32, bitcast=True)
    n_q = tl.sum(tl.load(at + 4, mask=cm, other=0), 0)
    c_q = tl.sum(tl.load(at + 5, mask=cm, other=0), 0)
    vk = tl.max(tl.where(cm, vk, -float("inf")), 0)
    vv = tl.max(tl.where(cm, vv, -float("inf")), 0)
    return wk, wv, n_q, c_q, vk, vv


@triton.jit
def _record(REC, row, SCR, n_groups, nC, which: tl.constexpr, me, step, NC: tl.constexpr):
    """Write a backward check's record if group ``me`` is the first it flagged: over all groups,
    dQ (which 0: rows and columns summed, value 0) or dK / dV (1 / 2: a row a flagged group,
    the union of flagged columns, the first group's largest flagged sum), as the reference. On
    a flag only: a loop over the groups."""
    first = tl.full([], 2**31 - 1, tl.int64)
    n_rows = tl.zeros([], dtype=tl.int32)
    n_cols = tl.zeros([], dtype=tl.int32)
    union = tl.zeros([NC], dtype=tl.int32)
    value = tl.zeros([], dtype=tl.float32)
    for g in range(0, n_groups):
        wk, wv, n_q, c_q, vk, vv = _entries(SCR, g, nC, NC)
        if which == 0:
            if n_q > 0:
                first = tl.minimum(first, g)
                n_rows += n_q
                n_cols += c_q
        else:
            w = wk if which == 1 else wv
            if tl.sum(w, 0) > 0:
                if first > g:
                    first = g
                    value = vk if which == 1 else vv
                n_rows += 1
                union = union | w
    if which != 0:
        n_cols = tl.sum(popcount16(union), 0)
    if first == me:
        add_record(REC, row, n_rows, n_cols, value, step)


@triton.jit
def _group_of(SCR, bh, H, rep, nC, NC: tl.constexpr):
    """(b, h, the K/V group bkv, its entries: dK's and dV's flagged-column words, dQ's flagged
    rows; whether it flagged at all) of query head ``bh``."""
    Hkv = H // rep
    b, h = bh // H, bh % H
    bkv = b * Hkv + h // rep
    wk, wv, n_q, _cq, _vk, _vv = _entries(SCR, bkv, nC, NC)
    n_k, n_v = tl.sum(wk, 0), tl.sum(wv, 0)  # (nonzero: a flagged column)
    return b, h, bkv, n_k, n_v, n_q, (n_q + n_k + n_v) > 0


@triton.jit
def bwd_repair_q_kernel(Q, K, V, M, Out, LSE, DO, DQ, DK, DV, STATS, RMX, GRP, NEW, FLAGS, SCR,
                        REC, STEP, row_q, row_k, row_v, H, rep, L, Lk, d, S, nM, nC,
                        sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                        sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                        sg_b, sg_h, sg_l, sg_d, sdq_b, sdq_h, sdq_l, sdq_d,
                        sdk_b, sdk_h, sdk_l, sdk_d, sdv_b, sdv_h, sdv_l, sdv_d, sr_b, sr_h, sr_l,
                        scale, scale_abs, c_k, tol, floor_k, floor_v, c_q, floor_q,
                        HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                        NC: tl.constexpr):  # fmt: skip
    """Program (block p of query rows, query head): one vector load of its group's entries
    (:func:`bwd_check_kernel`'s) and a return on a clean group; else dQ's block p of its head
    recomputed (FlashAttention-2's backward from the saved LSE), its bound checked again from
    registers, and the first flagged group's program 0 writes dQ's record. Its parameters are
    :func:`bwd_repair_kv_kernel`'s (one argument list for both)."""
    p, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    b, h, bkv, _nk, _nv, n_q, flagged = _group_of(SCR, bh, H, rep, nC, NC)
    if flagged:  # the device flag: nothing below runs for a clean group
        g = h // rep
        ds = tl.arange(0, BD)
        dm = ds < d
        claims = FLAGS + 2 * tl.num_programs(1).to(tl.int64) * nM
        Kh, Vh = K + b * sk_b + g * sk_h, V + b * sv_b + g * sv_h
        _, _, ka, _, va = head_stats(STATS, bkv, S, d, ds, dm)
        rows = (p * BM + tl.arange(0, BM)).to(tl.int64)
        rm = rows < L
        q = tile(Q + b * sq_b + h * sq_h, rows, ds, sq_l, sq_d, rm, dm)
        dq = tl.zeros([BM, BD], dtype=tl.float32)
        for nb in range(0, tl.cdiv(Lk, BN)):
            cols = (nb * BN + tl.arange(0, BN)).to(tl.int64)
            cm = cols < Lk
            v = tile(Vh, cols, ds, sv_l, sv_d, cm, dm)
            k, _p, _do, dsc = _block(
                q, Kh, M + b * sm_b + h * sm_h, Out + b * so_b + h * so_h,
                LSE + b * sl_b + h * sl_h, DO + b * sg_b + h * sg_h, v, rows, rm, cols, cm,
                ds, dm, sk_l, sk_d, sm_l, sm_k, so_l, so_d, sl_l, sg_l, sg_d, scale,
                HAS_MASK, CAUSAL, IEEE,
            )  # fmt: skip
            dq += dot(dsc.to(k.dtype), k, IEEE) * scale
        both = rm[:, None] & dm[None, :]
        newq = dq.to(DQ.dtype.element_ty)
        tl.store(DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_l + ds[None, :] * sdq_d,
                 newq, mask=both)  # fmt: skip
        # dQ's bound again on the new rows, from registers
        g_ = tile(DO + b * sg_b + h * sg_h, rows, ds, sg_l, sg_d, rm, dm)
        rmx = tl.load(RMX + b * sr_b + h * sr_h + rows * sr_l, mask=rm, other=_DEAD)
        a = tl.sum(tl.abs(g_.to(tl.float32)), 1) * va * tl.where(rmx > _DEAD, 1.0, Lk * 1.0)
        bound = c_q * 2 * scale_abs * a[:, None] * ka[None, :] + floor_q
        worse = ~(tl.abs(newq.to(tl.float32)) - bound <= 0.0) & both
        if (n_q > 0) & (tl.sum(tl.max(worse.to(tl.int32), 1), 0) > 0):
            mark_lost(REC, row_q, claims + 3)
        if (p == 0) & ((h % rep) == 0) & (n_q > 0):  # the record, by the first flagged group
            n_groups = tl.num_programs(1).to(tl.int64) // rep
            _record(REC, row_q, SCR, n_groups, nC, 0, bkv, tl.load(STEP), NC)


@triton.jit
def bwd_repair_kv_kernel(Q, K, V, M, Out, LSE, DO, DQ, DK, DV, STATS, RMX, GRP, NEW, FLAGS, SCR,
                         REC, STEP, row_q, row_k, row_v, H, rep, L, Lk, d, S, nM, nC,
                         sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                         sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                         sg_b, sg_h, sg_l, sg_d, sdq_b, sdq_h, sdq_l, sdq_d,
                         sdk_b, sdk_h, sdk_l, sdk_d, sdv_b, sdv_h, sdv_l, sdv_d, sr_b, sr_h, sr_l,
                         scale, scale_abs, c_k, tol, floor_k, floor_v, c_q, floor_q,
                         HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                         NC: tl.constexpr):  # fmt: skip
    """Program (block p of key rows, K/V head group): one vector load of the group's entries
    and a return on a clean group; else dK's and dV's block p recomputed over the group's
    heads, its column sums stored, and the last of the group's programs to arrive checks the
    new sums (in block order: the same whoever arrives last); the first flagged group's
    program 0 writes dK's and dV's records (nothing depends on which program runs first).

    Its parameters, in groups (Triton takes scalars, not structs):

    - tensors: Q, K, V, M (the additive mask), Out, LSE, DO (the output gradient), DQ, DK, DV
      (repaired in place), STATS (:func:`~attnchecker.kernels.sdpa_kernels.kv_stats`), RMX (each
      row's largest mask value), GRP (the group's reduced sums), NEW (the new dK / dV sums a
      key block), FLAGS (:func:`bwd_rows`' and the records' claims), SCR (the groups' entries
      and arrival counters), REC (the records), STEP (the clock);
    - the record rows of dq, dk, dv (-1: none) and the sizes: H, rep (query heads per K/V head),
      L, Lk, d, S (key chunks of the stats), nM (the query partials' blocks), nC (column
      chunks);
    - the strides, four a tensor (batch, head, row, column; three for the LSE and RMX), named
      s<tensor>_<dim>: q, k, v, m (the mask), o, l (the LSE), g (dO), dq, dk, dv, r (RMX);
    - the constants of :func:`bwd_consts` (scale and the tolerances), as the reference derives
      them;
    - compile-time: the mask, causality, IEEE products, the recomputation's blocks BM, BN
      (smaller than the partials': a rare path that must not spill), BD (d padded), NC (column
      chunks, padded)."""
    p, bkv = tl.program_id(0), tl.program_id(1).to(tl.int64)
    first = (bkv // (H // rep)) * H + (bkv % (H // rep)) * rep  # the group's first query head
    b, h, _bkv, n_k, n_v, _nq, flagged = _group_of(SCR, first, H, rep, nC, NC)
    if flagged:  # the device flag: nothing below runs for a clean group
        g = h // rep
        ds = tl.arange(0, BD)
        dm = ds < d
        claims = FLAGS + 2 * (tl.num_programs(1).to(tl.int64) * rep) * nM
        Kh, Vh = K + b * sk_b + g * sk_h, V + b * sv_b + g * sv_h
        nN = tl.cdiv(Lk, BN)
        cols = (p * BN + tl.arange(0, BN)).to(tl.int64)
        cm = cols < Lk
        dk = tl.zeros([BN, BD], dtype=tl.float32)
        dv = tl.zeros([BN, BD], dtype=tl.float32)
        v = tile(Vh, cols, ds, sv_l, sv_d, cm, dm)
        for r in range(0, rep):
            hr = g * rep + r
            for mb in range(0, tl.cdiv(L, BM)):
                rows = (mb * BM + tl.arange(0, BM)).to(tl.int64)
                rm = rows < L
                q = tile(Q + b * sq_b + hr * sq_h, rows, ds, sq_l, sq_d, rm, dm)
                _k, pr, do, dsc = _block(
                    q, Kh, M + b * sm_b + hr * sm_h, Out + b * so_b + hr * so_h,
                    LSE + b * sl_b + hr * sl_h, DO + b * sg_b + hr * sg_h, v, rows, rm, cols,
                    cm, ds, dm, sk_l, sk_d, sm_l, sm_k, so_l, so_d, sl_l, sg_l, sg_d, scale,
                    HAS_MASK, CAUSAL, IEEE,
                )  # fmt: skip
                dv += dot(tl.trans(pr.to(do.dtype)), do, IEEE)
                dk += dot(tl.trans(dsc.to(q.dtype)), q, IEEE) * scale
        both = cm[:, None] & dm[None, :]
        dk_ = dk.to(DK.dtype.element_ty)
        dv_ = dv.to(DV.dtype.element_ty)
        tl.store(DK + b * sdk_b + g * sdk_h + cols[:, None] * sdk_l + ds[None, :] * sdk_d,
                 dk_, mask=both)  # fmt: skip
        tl.store(DV + b * sdv_b + g * sdv_h + cols[:, None] * sdv_l + ds[None, :] * sdv_d,
                 dv_, mask=both)  # fmt: skip
        new = NEW + (bkv * nN + p) * 2 * d
        tl.store(new + ds, tl.sum(tl.where(both, dk_.to(tl.float32), 0.0), 0), mask=dm)
        tl.store(new + d + ds, tl.sum(tl.where(both, dv_.to(tl.float32), 0.0), 0), mask=dm)
        tl.debug_barrier()  # every warp's sums stored before the arrival is counted
        counter = SCR + tl.num_programs(1).to(tl.int64) * nC * _ENTRY + bkv
        if tl.atomic_add(counter, 1, sem="acq_rel") == nN - 1:  # the group's last block
            tl.debug_barrier()
            sk = tl.zeros([BD], dtype=tl.float32)
            sv = tl.zeros([BD], dtype=tl.float32)
            for j in range(0, nN):  # in block order: the same sums whoever arrives last
                sk += tl.load(NEW + (bkv * nN + j) * 2 * d + ds, mask=dm, other=0.0)
                sv += tl.load(NEW + (bkv * nN + j) * 2 * d + d + ds, mask=dm, other=0.0)
            grp = GRP + bkv * (3 * d + 1)
            ref = tl.load(grp + ds, mask=dm, other=0.0)
            tv = tl.load(grp + d + ds, mask=dm, other=0.0)
            qa = tl.load(grp + 2 * d + ds, mask=dm, other=0.0)
            k_bad, v_bad = _sums_bad(ref, tv, qa, tl.load(grp + 3 * d), sk, sv, dm, scale_abs,
                                     c_k, tol, floor_k, floor_v, 1.0, ref, False)  # fmt: skip
            if (n_k > 0) & (tl.sum(k_bad.to(tl.int32), 0) > 0):
                mark_lost(REC, row_k, claims + 4)
            if (n_v > 0) & (tl.sum(v_bad.to(tl.int32), 0) > 0):
                mark_lost(REC, row_v, claims + 5)
        if p == 0:  # the records, by the first group each flagged
            n_groups = tl.num_programs(1).to(tl.int64)
            step = tl.load(STEP)
            if n_k > 0:
                _record(REC, row_k, SCR, n_groups, nC, 1, bkv, step, NC)
            if n_v > 0:
                _record(REC, row_v, SCR, n_groups, nC, 2, bkv, step, NC)


@triton.jit
def _block(q, Kh, Mh, Oh, Lh, Gh, v, rows, rm, cols, cm, ds, dm, sk_l, sk_d, sm_l, sm_k, so_l,
           so_d, sl_l, sg_l, sg_d, scale, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
           IEEE: tl.constexpr):  # fmt: skip
    """(K's tile, P, dO, dS) of a (rows, cols) block of one head (pointers at the head):
    P = exp(z - LSE) (0 where excluded), dS = P (dO v^T - D), D_i = dO_i . O_i (the delivered
    O)."""
    z, k = block_scores(q, Kh, Mh, rows, cols, rm, cm, ds, dm, sk_l, sk_d, sm_l, sm_k, scale,
                        HAS_MASK, CAUSAL, IEEE)  # fmt: skip
    lse = tl.load(Lh + rows * sl_l, mask=rm, other=0.0)
    p = tl.where(z == -float("inf"), 0.0, tl.exp(z - lse[:, None]))
    do = tile(Gh, rows, ds, sg_l, sg_d, rm, dm)
    o = tile(Oh, rows, ds, so_l, so_d, rm, dm)
    dd = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    dp = dot(do, tl.trans(v), IEEE)
    return k, p, do, p * (dp - dd[:, None])


# ------------------------------------------------------------------------------ the launchers


def bwd_consts(q: Tensor, k: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, scale: float,
               tol: float) -> dict[str, float]:  # fmt: skip
    """The backward checks' constants, as the reference derives them."""
    L, d, Lk = q.shape[2], q.shape[3], k.shape[2]
    eps = torch.finfo(q.dtype).eps
    return {"scale_abs": abs(scale), "c_k": 4 * eps + (L + Lk + d) * EPS32, "tol": tol,
            "floor_k": underflow_floor(dk.dtype, length=Lk, inner=L),
            "floor_v": underflow_floor(dv.dtype, length=Lk, inner=L),
            "w_live": 2 * eps + (L + Lk) * EPS32,
            "c_q": 1 + tol * 4 * (3 * eps + (Lk + d) * EPS32),
            "floor_q": tol * 4 * underflow_floor(dq.dtype, length=1, inner=Lk)}  # fmt: skip


def bwd_rows(q, k, lse, grad, dq, stats, rowmax, scale: float, tol: float, dropout: float = 0.0):
    """dQ's bound and the query-side partial sums, per block of query rows: (partials fp32,
    flags int32; its last 8 entries, zeroed, are the records' claims); ``dropout``: the call's
    attention dropout (the bounds scaled by 1 / (1 - p))."""
    B, H, L, d = q.shape
    Hkv, Lk, S = k.shape[1], k.shape[2], stats.shape[2]
    nM = triton.cdiv(L, _BM)
    part = torch.empty(B * H * nM * (4 * d + 1), device=q.device, dtype=_F32)
    flags = torch.empty(2 * B * H * nM + 8, device=q.device, dtype=torch.int32)
    qr, gr, dqr = readable(q), readable(grad), readable(dq)
    rmx = row_view(rowmax, q)
    c = bwd_consts(q, k, dq, dq, dq, scale, tol)
    bwd_q_kernel[(nM, B * H)](qr, gr, lse, dqr, stats, rmx, part, flags, H, H // Hkv, L, Lk, d,
                              S, nM, *qr.stride(), *gr.stride(), *lse.stride(), *dqr.stride(),
                              *rmx.stride(), c["scale_abs"], c["w_live"], c["c_q"], c["floor_q"],
                              1 / (1 - dropout), BM=_BM, BD=block_d(d))  # fmt: skip
    return part, flags


def bwd_cols(dk: Tensor, dv: Tensor) -> Tensor:
    """The column sums of dK and dV per block of key rows (fp32 partials)."""
    B, Hkv, Lk, d = dk.shape
    nN = triton.cdiv(Lk, _BN)
    part = torch.empty(B * Hkv * nN * 2 * d, device=dk.device, dtype=_F32)
    kr, vr = readable(dk), readable(dv)
    bwd_kv_kernel[(nN, B * Hkv)](kr, vr, part, Hkv, Lk, d, nN, *kr.stride(), *vr.stride(), BN=_BN,
                                 BD=block_d(d))  # fmt: skip
    return part


def group_check(q, k, dq, dk, dv, qpart, flags, kvpart, scale: float, tol: float,
                dropout: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`bwd_check_kernel` over every (K/V head group, 16 columns): (the groups' reduced
    sums, their entries and arrival counters)."""
    B, H, L, d = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    nM, nN, nC = triton.cdiv(L, _BM), triton.cdiv(Lk, _BN), triton.cdiv(d, _DC)
    c = bwd_consts(q, k, dq, dk, dv, scale, tol)
    grp = torch.empty(B * Hkv * (3 * d + 1), device=q.device, dtype=_F32)
    scr = torch.empty(B * Hkv * (nC * _ENTRY + 1), device=q.device, dtype=torch.int32)
    bwd_check_kernel[(B * Hkv, nC)](qpart, kvpart, flags, grp, scr, H // Hkv, d, nM, nN,
                                    c["scale_abs"], c["c_k"], c["tol"], c["floor_k"],
                                    c["floor_v"], 1 / (1 - dropout), BJ=64, DC=_DC,
                                    DROP=dropout > 0)  # fmt: skip
    return grp, scr


def bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, qpart, flags, kvpart,
               rec, step, rows, causal: bool, scale: float, tol: float) -> None:  # fmt: skip
    """Compare the partials per K/V head group (:func:`bwd_check_kernel`); recompute the
    failing groups' dQ, dK, dV in place (:func:`bwd_repair_q_kernel`,
    :func:`bwd_repair_kv_kernel`), their records into ``rec`` rows ``rows`` (dq, dk, dv; -1:
    none): three launches, nothing written on a clean call but the scratch."""
    B, H, L, d = q.shape
    Hkv, Lk, S = k.shape[1], k.shape[2], stats.shape[2]
    nM, BD = triton.cdiv(L, _BM), block_d(d)
    RB = 16  # the recomputation's blocks (a rare path: small tiles, more warps, no spill)
    nC = triton.cdiv(d, _DC)
    c = bwd_consts(q, k, dq, dk, dv, scale, tol)
    grp, scr = group_check(q, k, dq, dk, dv, qpart, flags, kvpart, scale, tol)
    new = torch.empty(B * Hkv * triton.cdiv(Lk, RB) * 2 * d, device=q.device, dtype=_F32)
    qr, kr, vr, orr, gr = (readable(t) for t in (q, k, v, out, grad))
    dqr, dkr, dvr = (readable(t) for t in (dq, dk, dv))
    m, sm, has_mask = mask_view(mask, q, Lk)
    rmx = row_view(rowmax, q)
    args = (
        qr, kr, vr, m, orr, lse, gr, dqr, dkr, dvr, stats, rmx, grp, new, flags, scr, rec, step,
        rows[0], rows[1], rows[2], H, H // Hkv, L, Lk, d, S, nM, nC,
        *qr.stride(), *kr.stride(), *vr.stride(), *sm, *orr.stride(), *lse.stride(),
        *gr.stride(), *dqr.stride(), *dkr.stride(), *dvr.stride(), *rmx.stride(),
        scale, c["scale_abs"], c["c_k"], c["tol"], c["floor_k"], c["floor_v"], c["c_q"],
        c["floor_q"],
    )  # fmt: skip
    meta = {"HAS_MASK": has_mask, "CAUSAL": causal, "IEEE": use_ieee(q), "BM": RB, "BN": RB,
            "BD": BD, "NC": triton.next_power_of_2(triton.cdiv(BD, _DC))}  # fmt: skip
    bwd_repair_q_kernel[(triton.cdiv(L, RB), B * H)](*args, **meta, num_warps=8)
    bwd_repair_kv_kernel[(triton.cdiv(Lk, RB), B * Hkv)](*args, **meta, num_warps=8, num_stages=1)
    for t, r in ((dq, dqr), (dk, dkr), (dv, dvr)):
        if r is not t:  # the interpreter's fp32 copies
            t.copy_(r)


# ------------------------------------------------------------------------ the registered ops
# The Triton family's backward ops (schemas: sdpa_check.SCHEMAS), each one launch; their fakes
# give the scratch these kernels exchange.


def _bwd_verify_op(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step, rows, scale, tol,
                   dropout=0.0):  # fmt: skip
    return bwd_rows(q, k, lse, grad, dq, stats, rowmax, scale, tol, dropout)


def _bwd_repair_op(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, qpart, flags, kvpart,
                   rec, step, rows, causal, scale, tol, dropout=0.0, rng=None):  # fmt: skip
    if dropout > 0:  # the kernel's draw is not the repair kernels': the reference's, on a flag
        _, scr = group_check(q, k, dq, dk, dv, qpart, flags, kvpart, scale, tol, dropout)
        n = scr.numel() - k.shape[0] * k.shape[1]  # (the arrival counters after the entries)
        if host_flag(scr[:n]):  # (an entry is all zero but for a flag)
            stats = reduce_stats(stats)
            bad = sdpa_check.bwd_verify(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step,
                                        tuple(rows), scale, tol, dropout)  # fmt: skip
            sdpa_check.bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, bad,
                                  rec, tuple(rows), causal, scale, tol, dropout, rng)  # fmt: skip
        return
    bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, qpart, flags, kvpart,
               rec, step, rows, causal, scale, tol)  # fmt: skip


def _bwd_verify_fake(q, *_):
    B, H, L, d = q.shape
    nM = triton.cdiv(L, _BM)
    return (q.new_empty(B * H * nM * (4 * d + 1), dtype=_F32),
            q.new_empty(2 * B * H * nM + 8, dtype=torch.int32))  # fmt: skip


def _bwd_sums_fake(dk, dv):
    B, Hkv, Lk, d = dk.shape
    return dk.new_empty(B * Hkv * triton.cdiv(Lk, _BN) * 2 * d, dtype=_F32)


TRITON_OPS = SdpaOps(
    kv_stats=kv_stats_op,
    fwd_verify=fwd_verify_op,
    fwd_repair=fwd_repair_op,
    bwd_verify=define("sdpa_bwd_verify", _bwd_verify_op, _bwd_verify_fake, suffix="_triton"),
    bwd_sums=define("sdpa_bwd_sums", bwd_cols, _bwd_sums_fake, suffix="_triton"),
    bwd_repair=define("sdpa_bwd_repair", _bwd_repair_op, lambda *_: None, suffix="_triton"),
)
"""The SDPA route's check ops as Triton kernels (CUDA's default, ``check_impl="auto"``; the
interpreter in tests): the repairs read their flags on the device, no host synchronisation."""
