"""The SDPA route's backward checks as Triton kernels (the forward's:
:mod:`attnchecker.kernels.sdpa_kernels`; the shared helpers:
:mod:`~attnchecker.kernels.triton_utils`), three launches a layer, none waiting for the host:

- ``bwd_q_kernel``: per block of query rows, dQ's bound and the partial sums the dV and dK
  checks compare with (sum live_i dO_i, its tolerance, sum a_i |q_i|);
- ``bwd_kv_kernel``: per block of key rows, the column sums of dK and dV;
- ``bwd_repair_kernel``: per K/V head group: reduces the partials, compares; returns unless a
  check failed; else adds the records, recomputes the group's dQ, dK, dV (FlashAttention-2's
  backward from the saved LSE: P = exp(s - LSE), dS = P (dP - D)) and checks them again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.tolerance import underflow_floor
from attnchecker.kernels import DEAD, SDPA_BLOCKS
from attnchecker.kernels.sdpa_check import SdpaOps, define
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
    readable,
    row_view,
    tile,
    use_ieee,
)

__all__ = ["bwd_cols", "bwd_repair", "bwd_rows"]

_F32 = torch.float32
_BM, _BN = SDPA_BLOCKS[1:]
_DEAD = tl.constexpr(DEAD)


@triton.jit
def bwd_q_kernel(Q, DO, LSE, DQ, STATS, RMX, PART, FLAGS, H, rep, L, Lk, d, S, nM,
                 sq_b, sq_h, sq_l, sq_d, sg_b, sg_h, sg_l, sg_d, sl_b, sl_h, sl_l,
                 sd_b, sd_h, sd_l, sd_d, sr_b, sr_h, sr_l, scale_abs, w_live, c_q, floor_q,
                 BM: tl.constexpr, BD: tl.constexpr):  # fmt: skip
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
    a = tl.sum(tl.abs(g), 1) * va * tl.where(live, 1.0, Lk * 1.0)
    bound = c_q * 2 * scale_abs * a[:, None] * ka[None, :] + floor_q
    q_bad = ~(tl.abs(dq) - bound <= 0.0) & rm[:, None] & dm[None, :]
    w = tl.where(live, w_live + EPS32_K * lse_abs, Lk * 1.0)
    w = tl.where(rm, w, 0.0)
    at = PART + (bh.to(tl.int64) * nM + pm) * (3 * d + 1)
    tl.store(at + ds, tl.sum(tl.where(live[:, None], g, 0.0), 0), mask=dm)
    tl.store(at + d + ds, tl.sum(w[:, None] * tl.abs(g), 0), mask=dm)
    tl.store(at + 2 * d + ds, tl.sum(a[:, None] * tl.abs(q), 0), mask=dm)
    tl.store(at + 3 * d, tl.max(lse_abs, 0))
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
def _group(QP, KVP, FLAGS, bkv, rep, d, nM, nN, ds, dm, BD: tl.constexpr):
    """The reduced partials of one K/V head group: (ref, tol_v, qa (d,), max |LSE|, sum dK,
    sum dV (d,), flagged dQ rows, flagged dQ columns)."""
    ref = tl.zeros([BD], dtype=tl.float32)
    tv = tl.zeros([BD], dtype=tl.float32)
    qa = tl.zeros([BD], dtype=tl.float32)
    lm = tl.zeros([], dtype=tl.float32)
    n_q = tl.zeros([], dtype=tl.int32)
    c_q = tl.zeros([], dtype=tl.int32)
    for r in range(0, rep):
        bh = bkv.to(tl.int64) * rep + r
        for j in range(0, nM):
            at = QP + (bh * nM + j) * (3 * d + 1)
            ref += tl.load(at + ds, mask=dm, other=0.0)
            tv += tl.load(at + d + ds, mask=dm, other=0.0)
            qa += tl.load(at + 2 * d + ds, mask=dm, other=0.0)
            lm = tl.maximum(lm, tl.load(at + 3 * d))
            n_q += tl.load(FLAGS + 2 * (bh * nM + j))
            c_q += tl.load(FLAGS + 2 * (bh * nM + j) + 1)
    sk = tl.zeros([BD], dtype=tl.float32)
    sv = tl.zeros([BD], dtype=tl.float32)
    for j in range(0, nN):
        at = KVP + (bkv.to(tl.int64) * nN + j) * (2 * d)
        sk += tl.load(at + ds, mask=dm, other=0.0)
        sv += tl.load(at + d + ds, mask=dm, other=0.0)
    return ref, tv, qa, lm, sk, sv, n_q, c_q


@triton.jit
def _sums_bad(ref, tv, qa, lm, sk, sv, dm, scale_abs, c_k, tol, floor_k, floor_v):
    """(dK's flagged columns, dV's) of a group."""
    t_k = tol * 4 * ((c_k + EPS32_K * lm) * scale_abs * 2 * qa + floor_k)
    t_v = tol * 4 * (tv + floor_v)
    k_bad = ~(tl.abs(sk) - t_k <= 0.0) & dm
    v_bad = ~(tl.abs(sv - ref) - t_v <= 0.0) & dm
    return k_bad, v_bad


@triton.jit
def bwd_repair_kernel(Q, K, V, M, Out, LSE, DO, DQ, DK, DV, STATS, RMX, QP, KVP, FLAGS, REC, STEP,
                      row_q, row_k, row_v, H, rep, L, Lk, d, S, nM, nN,
                      sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                      sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                      sg_b, sg_h, sg_l, sg_d, sdq_b, sdq_h, sdq_l, sdq_d,
                      sdk_b, sdk_h, sdk_l, sdk_d, sdv_b, sdv_h, sdv_l, sdv_d, sr_b, sr_h, sr_l,
                      scale, scale_abs, c_k, tol, floor_k, floor_v, w_live, c_q, floor_q,
                      HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """One program per (batch, K/V head group): compare the group's partials, return on a clean
    one, else record, recompute the group's dQ, dK, dV and check them again.

    Its parameters, in groups (Triton takes scalars, not structs):

    - tensors: Q, K, V, M (the additive mask), Out, LSE, DO (the output gradient), DQ, DK, DV
      (repaired in place), STATS (:func:`~attnchecker.kernels.sdpa_kernels.kv_stats`), RMX (each
      row's largest mask value), QP / KVP (the query-side and key-side partials of
      :func:`bwd_rows` / :func:`bwd_cols`), FLAGS (and the records' claims), REC (the records),
      STEP (the clock);
    - the record rows of dq, dk, dv (-1: none) and the sizes: H, rep (query heads per K/V head),
      L, Lk, d, S (key chunks of the stats), nM, nN (the partials' blocks);
    - the strides, four a tensor (batch, head, row, column; three for the LSE and RMX), named
      s<tensor>_<dim>: q, k, v, m (the mask), o, l (the LSE), g (dO), dq, dk, dv, r (RMX);
    - the constants of :func:`bwd_consts` (scale and the tolerances), as the reference derives
      them;
    - compile-time: the mask, causality, IEEE products, and the recomputation's blocks BM, BN
      (smaller than the partials': a rare path that must not spill), BD (d padded)."""
    bkv = tl.program_id(0).to(tl.int64)
    Hkv = H // rep
    b, g = bkv // Hkv, bkv % Hkv
    ds = tl.arange(0, BD)
    dm = ds < d
    ref, tv, qa, lm, sk, sv, n_q, c_qn = _group(QP, KVP, FLAGS, bkv, rep, d, nM, nN, ds, dm, BD)
    k_bad, v_bad = _sums_bad(ref, tv, qa, lm, sk, sv, dm, scale_abs, c_k, tol, floor_k, floor_v)
    n_k = tl.sum(k_bad.to(tl.int32), 0)
    n_v = tl.sum(v_bad.to(tl.int32), 0)
    if (n_q + n_k + n_v) > 0:  # the device flag: nothing below runs for a clean group
        claims = FLAGS + 2 * tl.num_programs(0).to(tl.int64) * rep * nM
        step = tl.load(STEP)
        zero = tl.zeros([], dtype=tl.int32)
        if n_q > 0:
            add_record(REC, row_q, claims, n_q, c_qn, tl.zeros([], dtype=tl.float32), step)
        if n_k > 0:
            add_record(REC, row_k, claims + 1, zero + 1, n_k, tl.max(tl.where(k_bad, sk, 0.0), 0),
                       step)  # fmt: skip
        if n_v > 0:
            add_record(REC, row_v, claims + 2, zero + 1, n_v, tl.max(tl.where(v_bad, sv, 0.0), 0),
                       step)  # fmt: skip
        Kh, Vh = K + b * sk_b + g * sk_h, V + b * sv_b + g * sv_h
        new_sk = tl.zeros([BD], dtype=tl.float32)
        new_sv = tl.zeros([BD], dtype=tl.float32)
        again_q = tl.zeros([], dtype=tl.int32)
        _, _, ka, _, va = head_stats(STATS, bkv, S, d, ds, dm)
        # dK, dV of every key block, over the group's heads and query blocks
        for nb in range(0, tl.cdiv(Lk, BN)):
            cols = (nb * BN + tl.arange(0, BN)).to(tl.int64)
            cm = cols < Lk
            dk = tl.zeros([BN, BD], dtype=tl.float32)
            dv = tl.zeros([BN, BD], dtype=tl.float32)
            v = tile(Vh, cols, ds, sv_l, sv_d, cm, dm)
            for r in range(0, rep):
                h = g * rep + r
                for mb in range(0, tl.cdiv(L, BM)):
                    rows = (mb * BM + tl.arange(0, BM)).to(tl.int64)
                    rm = rows < L
                    q = tile(Q + b * sq_b + h * sq_h, rows, ds, sq_l, sq_d, rm, dm)
                    k, p, do, dsc = _block(
                        q, Kh, M + b * sm_b + h * sm_h, Out + b * so_b + h * so_h,
                        LSE + b * sl_b + h * sl_h, DO + b * sg_b + h * sg_h, v, rows, rm, cols, cm,
                        ds, dm, sk_l, sk_d, sm_l, sm_k, so_l, so_d, sl_l, sg_l, sg_d, scale,
                        HAS_MASK, CAUSAL, IEEE,
                    )  # fmt: skip
                    dv += dot(tl.trans(p.to(do.dtype)), do, IEEE)
                    dk += dot(tl.trans(dsc.to(q.dtype)), q, IEEE) * scale
            both = cm[:, None] & dm[None, :]
            tl.store(DK + b * sdk_b + g * sdk_h + cols[:, None] * sdk_l + ds[None, :] * sdk_d,
                     dk.to(DK.dtype.element_ty), mask=both)  # fmt: skip
            tl.store(DV + b * sdv_b + g * sdv_h + cols[:, None] * sdv_l + ds[None, :] * sdv_d,
                     dv.to(DV.dtype.element_ty), mask=both)  # fmt: skip
            new_sk += tl.sum(tl.where(both, dk.to(DK.dtype.element_ty).to(tl.float32), 0.0), 0)
            new_sv += tl.sum(tl.where(both, dv.to(DV.dtype.element_ty).to(tl.float32), 0.0), 0)
        # dQ of every query block of the group's heads, over the key blocks
        for r in range(0, rep):
            h = g * rep + r
            for mb in range(0, tl.cdiv(L, BM)):
                rows = (mb * BM + tl.arange(0, BM)).to(tl.int64)
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
                tl.store(DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_l + ds[None, :] * sdq_d,
                         dq.to(DQ.dtype.element_ty), mask=both)  # fmt: skip
                # dQ's bound again on the new rows
                g_ = tile(DO + b * sg_b + h * sg_h, rows, ds, sg_l, sg_d, rm, dm)
                rmx = tl.load(RMX + b * sr_b + h * sr_h + rows * sr_l, mask=rm, other=_DEAD)
                a = tl.sum(tl.abs(g_.to(tl.float32)), 1) * va * tl.where(rmx > _DEAD, 1.0, Lk * 1.0)
                bound = c_q * 2 * scale_abs * a[:, None] * ka[None, :] + floor_q
                newq = dq.to(DQ.dtype.element_ty).to(tl.float32)
                worse = ~(tl.abs(newq) - bound <= 0.0) & both
                again_q += tl.sum(tl.max(worse.to(tl.int32), 1), 0)
        k_bad, v_bad = _sums_bad(ref, tv, qa, lm, new_sk, new_sv, dm, scale_abs, c_k, tol,
                                 floor_k, floor_v)  # fmt: skip
        if (n_q > 0) & (again_q > 0):
            mark_lost(REC, row_q, claims + 3)
        if (n_k > 0) & (tl.sum(k_bad.to(tl.int32), 0) > 0):
            mark_lost(REC, row_k, claims + 4)
        if (n_v > 0) & (tl.sum(v_bad.to(tl.int32), 0) > 0):
            mark_lost(REC, row_v, claims + 5)


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


def bwd_rows(q, k, lse, grad, dq, stats, rowmax, scale: float, tol: float):
    """dQ's bound and the query-side partial sums, per block of query rows: (partials fp32,
    flags int32; its last 8 entries, zeroed, are the records' claims)."""
    B, H, L, d = q.shape
    Hkv, Lk, S = k.shape[1], k.shape[2], stats.shape[2]
    nM = triton.cdiv(L, _BM)
    part = torch.empty(B * H * nM * (3 * d + 1), device=q.device, dtype=_F32)
    flags = torch.empty(2 * B * H * nM + 8, device=q.device, dtype=torch.int32)
    qr, gr, dqr = readable(q), readable(grad), readable(dq)
    rmx = row_view(rowmax, q)
    c = bwd_consts(q, k, dq, dq, dq, scale, tol)
    bwd_q_kernel[(nM, B * H)](qr, gr, lse, dqr, stats, rmx, part, flags, H, H // Hkv, L, Lk, d,
                              S, nM, *qr.stride(), *gr.stride(), *lse.stride(), *dqr.stride(),
                              *rmx.stride(), c["scale_abs"], c["w_live"], c["c_q"], c["floor_q"],
                              BM=_BM, BD=block_d(d))  # fmt: skip
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


def bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, qpart, flags, kvpart,
               rec, step, rows, causal: bool, scale: float, tol: float) -> None:  # fmt: skip
    """Compare the partials per K/V head group; recompute the failing groups' dQ, dK, dV in
    place, their records into ``rec`` rows ``rows`` (dq, dk, dv; -1: none): nothing on a clean
    call."""
    B, H, L, d = q.shape
    Hkv, Lk, S = k.shape[1], k.shape[2], stats.shape[2]
    nM, nN = triton.cdiv(L, _BM), triton.cdiv(Lk, _BN)
    qr, kr, vr, orr, gr = (readable(t) for t in (q, k, v, out, grad))
    dqr, dkr, dvr = (readable(t) for t in (dq, dk, dv))
    m, sm, has_mask = mask_view(mask, q, Lk)
    rmx = row_view(rowmax, q)
    c = bwd_consts(q, k, dq, dk, dv, scale, tol)
    bwd_repair_kernel[(B * Hkv,)](
        qr, kr, vr, m, orr, lse, gr, dqr, dkr, dvr, stats, rmx, qpart, kvpart, flags, rec, step,
        rows[0], rows[1], rows[2], H, H // Hkv, L, Lk, d, S, nM, nN,
        *qr.stride(), *kr.stride(), *vr.stride(), *sm, *orr.stride(), *lse.stride(),
        *gr.stride(), *dqr.stride(), *dkr.stride(), *dvr.stride(), *rmx.stride(),
        scale, c["scale_abs"], c["c_k"], c["tol"], c["floor_k"], c["floor_v"], c["w_live"],
        c["c_q"], c["floor_q"],
        HAS_MASK=has_mask, CAUSAL=causal, IEEE=use_ieee(q), BM=16, BN=16, BD=block_d(d),
        num_warps=8,
    )  # fmt: skip
    for t, r in ((dq, dqr), (dk, dkr), (dv, dvr)):
        if r is not t:  # the interpreter's fp32 copies
            t.copy_(r)


# ------------------------------------------------------------------------ the registered ops
# The Triton family's backward ops (schemas: sdpa_check.SCHEMAS), each one launch; their fakes
# give the scratch these kernels exchange.


def _bwd_verify_op(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step, rows, scale, tol):
    return bwd_rows(q, k, lse, grad, dq, stats, rowmax, scale, tol)


def _bwd_verify_fake(q, *_):
    B, H, L, d = q.shape
    nM = triton.cdiv(L, _BM)
    return (q.new_empty(B * H * nM * (3 * d + 1), dtype=_F32),
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
    bwd_repair=define("sdpa_bwd_repair", bwd_repair, lambda *_: None, suffix="_triton"),
)
"""The SDPA route's check ops as Triton kernels (CUDA's default, ``check_impl="auto"``; the
interpreter in tests): the repairs read their flags on the device, no host synchronisation."""
