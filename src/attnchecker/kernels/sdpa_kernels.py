"""The SDPA route's checks as Triton kernels: what :mod:`attnchecker.kernels.sdpa_check`'s torch
reference computes, in six launches a layer (three here, three in
:mod:`~attnchecker.kernels.sdpa_kernels_bwd`), none of which waits for the host: the repairs
read the verify kernels' flags on the device and return at once on a clean call.

- ``kv_stats_kernel``: one pass over K and V, partial ranges per chunk of keys (no atomics, no
  zeroing: the consumers reduce the few chunks);
- ``fwd_verify_kernel``: per block of query rows, the LSE bounds and O's range; writes its flag
  bits and counts to a scratch the repair reads;
- ``fwd_repair_kernel``: per (batch, head): returns unless a block of its rows flagged; else adds
  the records, recomputes the head's O and LSE (online softmax over the keys, the mask and
  causality as SDPA's) and checks them again (lost / reproduced).

Records go straight into the module's log rows (forward) and the records tensor (backward), as
the reference writes them, except ``value`` (a flagged element's delivered value from the first
flagged head to claim the record, not the worst over all) and ``n_cols`` (flagged features
summed over flagged heads). The helpers both files use (tiles, the reduced stats, the records'
claims, scores of a block) are :mod:`~attnchecker.kernels.triton_utils`'.

On a CPU the kernels run in Triton's interpreter (tests): bf16 operands are read from fp32
copies there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from attnchecker.abft.tolerance import underflow_floor
from attnchecker.kernels import DEAD, SDPA_BLOCKS
from attnchecker.kernels.sdpa_check import define
from attnchecker.kernels.triton_utils import (
    EPS32,
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

__all__ = ["fwd_repair", "fwd_verify", "kv_stats", "stats_size"]

_CHUNK, _BM, _BN = SDPA_BLOCKS
_F32 = torch.float32
_DEAD = tl.constexpr(DEAD)


@triton.jit
def kv_stats_kernel(K, V, STATS, Hkv, Lk, d, S, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                    CH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    s, bkv = tl.program_id(0), tl.program_id(1)
    b, h = (bkv // Hkv).to(tl.int64), (bkv % Hkv).to(tl.int64)
    ds = tl.arange(0, BD)
    dm = ds < d
    lo = tl.full([BD], float("inf"), tl.float32)
    hi = tl.full([BD], -float("inf"), tl.float32)
    ka = tl.zeros([BD], dtype=tl.float32)
    kn = tl.zeros([BN], dtype=tl.float32)
    va = tl.zeros([BN], dtype=tl.float32)
    for n0 in range(0, CH, BN):
        rows = (s * CH + n0 + tl.arange(0, BN)).to(tl.int64)
        rm = rows < Lk
        k = tile(K + b * sk_b + h * sk_h, rows, ds, sk_l, sk_d, rm, dm).to(tl.float32)
        v = tile(V + b * sv_b + h * sv_h, rows, ds, sv_l, sv_d, rm, dm).to(tl.float32)
        both = rm[:, None] & dm[None, :]
        lo = tl.minimum(lo, tl.min(tl.where(both, v, float("inf")), 0))
        hi = tl.maximum(hi, tl.max(tl.where(both, v, -float("inf")), 0))
        ka = tl.maximum(ka, tl.max(tl.abs(k), 0))
        kn = tl.maximum(kn, tl.sqrt(tl.sum(k * k, 1)))
        va = tl.maximum(va, tl.max(tl.abs(v), 1))
    out = STATS + (bkv.to(tl.int64) * S + s) * (3 * d + 2)
    tl.store(out + ds, lo, mask=dm)
    tl.store(out + d + ds, hi, mask=dm)
    tl.store(out + 2 * d + ds, ka, mask=dm)
    tl.store(out + 3 * d, tl.max(kn, 0))
    tl.store(out + 3 * d + 1, tl.max(va, 0))


@triton.jit
def _fwd_flags(Q, Out, LSE, RMX, rows, rm, ds, dm, lo, hi, kn, sq_l, sq_d, so_l, so_d, sl_l, sr_l,
               scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs):  # fmt: skip
    """(lse_bad (BM,), o_bad (BM, BD), the LSE, O) of a block of rows (pointers at its head)."""
    q = tile(Q, rows, ds, sq_l, sq_d, rm, dm).to(tl.float32)
    lse = tl.load(LSE + rows * sl_l, mask=rm, other=0.0)
    rmx = tl.load(RMX + rows * sr_l, mask=rm, other=_DEAD)
    live = (rmx > _DEAD) & rm
    m = tl.where(live, rmx, 0.0)
    r = scale_abs * tl.sqrt(tl.sum(q * q, 1)) * kn
    slack = r * tol_rel + tol_abs
    exc = tl.maximum(lse - (m + r + logn + slack), (m - r - slack) - lse)
    lse_bad = ~(exc <= 0.0) & live
    o = tile(Out, rows, ds, so_l, so_d, rm, dm).to(tl.float32)
    t = hull_rel * tl.maximum(tl.abs(lo), tl.abs(hi)) + hull_abs
    oexc = tl.maximum(o - (hi + t)[None, :], (lo - t)[None, :] - o)
    o_bad = ~(oexc <= 0.0) & live[:, None] & dm[None, :]
    return lse_bad, o_bad, lse, o


@triton.jit
def fwd_verify_kernel(Q, Out, LSE, STATS, RMX, FLAGS, H, rep, L, d, S, nM,
                      sq_b, sq_h, sq_l, sq_d, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                      sr_b, sr_h, sr_l, scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs,
                      BM: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    pm, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    ds = tl.arange(0, BD)
    dm = ds < d
    lo, hi, _, kn, _ = head_stats(STATS, b * (H // rep) + h // rep, S, d, ds, dm)
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rm = rows < L
    lse_bad, o_bad, _, _ = _fwd_flags(
        Q + b * sq_b + h * sq_h, Out + b * so_b + h * so_h, LSE + b * sl_b + h * sl_h,
        RMX + b * sr_b + h * sr_h, rows, rm, ds, dm, lo, hi, kn, sq_l, sq_d, so_l, so_d, sl_l,
        sr_l, scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs,
    )  # fmt: skip
    n_l = tl.sum(lse_bad.to(tl.int32), 0)
    n_o = tl.sum(tl.max(o_bad.to(tl.int32), 1), 0)
    at = FLAGS + 3 * (bh.to(tl.int64) * nM + pm)
    tl.store(at, (n_l > 0).to(tl.int32) | ((n_o > 0).to(tl.int32) << 1))
    tl.store(at + 1, n_l)
    tl.store(at + 2, n_o)
    if (pm == 0) & (bh == 0):  # the records' claims, for the repair
        claims = FLAGS + 3 * (tl.num_programs(1).to(tl.int64) * nM) + tl.arange(0, 4)
        tl.store(claims, tl.zeros([4], dtype=tl.int32))


@triton.jit
def _first(values, bad):
    """A delivered value at a flagged position (NaN / INF ones first) of a block."""
    odd = bad & ~(tl.abs(values) < float("inf"))
    pick = tl.where(tl.max(odd.to(tl.int32), 0) > 0, odd, bad)
    return tl.sum(tl.where(pick & (tl.cumsum(pick.to(tl.int32), 0) == 1), values, 0.0), 0)


@triton.jit
def fwd_repair_kernel(Q, K, V, M, Out, LSE, STATS, RMX, FLAGS, LOG, STEP, row_s, row_c,
                      H, rep, L, Lk, d, S, nM,
                      sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                      sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                      sr_b, sr_h, sr_l, scale, scale_abs, logn, tol_rel, tol_abs, hull_rel,
                      hull_abs,
                      HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    flags = FLAGS + 3 * bh * nM
    f = tl.zeros([], dtype=tl.int32)
    for j in range(0, nM):
        f = f | tl.load(flags + 3 * j)
    if f != 0:  # the device flag: nothing below runs for a clean head
        b, h = bh // H, bh % H
        hkv = h // rep
        ds = tl.arange(0, BD)
        dm = ds < d
        lo, hi, _, kn, _ = head_stats(STATS, b * (H // rep) + hkv, S, d, ds, dm)
        Qh, Oh = Q + b * sq_b + h * sq_h, Out + b * so_b + h * so_h
        Kh, Vh = K + b * sk_b + hkv * sk_h, V + b * sv_b + hkv * sv_h
        Mh, Lh, Rh = M + b * sm_b + h * sm_h, LSE + b * sl_b + h * sl_h, RMX + b * sr_b + h * sr_h
        claims = FLAGS + 3 * tl.num_programs(0).to(tl.int64) * nM
        step = tl.load(STEP)
        n_l = tl.zeros([], dtype=tl.int32)
        n_o = tl.zeros([], dtype=tl.int32)
        cols_o = tl.zeros([BD], dtype=tl.int32)
        v_l = tl.zeros([], dtype=tl.float32)
        v_o = tl.zeros([], dtype=tl.float32)
        again_l = tl.zeros([], dtype=tl.int32)
        again_o = tl.zeros([], dtype=tl.int32)
        for mb in range(0, nM):
            rows = (mb * BM + tl.arange(0, BM)).to(tl.int64)
            rm = rows < L
            lse_bad, o_bad, lse_old, o_old = _fwd_flags(
                Qh, Oh, Lh, Rh, rows, rm, ds, dm, lo, hi, kn, sq_l, sq_d, so_l, so_d, sl_l,
                sr_l, scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs,
            )  # fmt: skip
            bad_rows = tl.max(o_bad.to(tl.int32), 1)  # (BM,)
            if (tl.sum(lse_bad.to(tl.int32), 0) > 0) & (n_l == 0):
                v_l = _first(lse_old, lse_bad)
            if (tl.sum(bad_rows, 0) > 0) & (n_o == 0):  # (a flagged row's first)
                first_col = tl.argmax(o_bad.to(tl.int32), 1)
                v_o = _first(tl.sum(tl.where(ds[None, :] == first_col[:, None], o_old, 0.0), 1),
                             bad_rows > 0)  # fmt: skip
            n_l += tl.sum(lse_bad.to(tl.int32), 0)
            n_o += tl.sum(bad_rows, 0)
            cols_o = tl.maximum(cols_o, tl.max(o_bad.to(tl.int32), 0))
            # the head's rows recomputed: online softmax over the keys
            q = tile(Qh, rows, ds, sq_l, sq_d, rm, dm)
            m_i = tl.full([BM], -float("inf"), tl.float32)
            l_i = tl.zeros([BM], dtype=tl.float32)
            acc = tl.zeros([BM, BD], dtype=tl.float32)
            end = Lk
            if CAUSAL:
                end = tl.minimum(Lk, (mb + 1) * BM)
            for n0 in range(0, end, BN):
                cols = (n0 + tl.arange(0, BN)).to(tl.int64)
                cm = cols < Lk
                z, _k = block_scores(q, Kh, Mh, rows, cols, rm, cm, ds, dm, sk_l, sk_d, sm_l, sm_k,
                                     scale, HAS_MASK, CAUSAL, IEEE)  # fmt: skip
                m_new = tl.maximum(m_i, tl.max(z, 1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                p = tl.exp(z - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                v = tile(Vh, cols, ds, sv_l, sv_d, cm, dm)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
                m_i = m_new
            l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row with no key (or past L): 0
            o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0)
            lse = tl.where(l_i > 0, m_i + tl.log(l_safe), 0.0)
            tl.store(Oh + rows[:, None] * so_l + ds[None, :] * so_d, o.to(Out.dtype.element_ty),
                     mask=rm[:, None] & dm[None, :])  # fmt: skip
            tl.store(Lh + rows * sl_l, lse, mask=rm)
            lse_bad, o_bad, _l, _o = _fwd_flags(
                Qh, Oh, Lh, Rh, rows, rm, ds, dm, lo, hi, kn, sq_l, sq_d, so_l, so_d, sl_l,
                sr_l, scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs,
            )  # fmt: skip
            again_l += tl.sum(lse_bad.to(tl.int32), 0)
            again_o += tl.sum(tl.max(o_bad.to(tl.int32), 1), 0)
        if n_l > 0:
            add_record(LOG, row_s, claims, n_l, tl.zeros([], dtype=tl.int32), v_l, step)
        if n_o > 0:
            add_record(LOG, row_c, claims + 1, n_o, tl.sum(cols_o, 0), v_o, step)
        if again_l > 0:
            mark_lost(LOG, row_s, claims + 2)
        if again_o > 0:
            mark_lost(LOG, row_c, claims + 3)


# ------------------------------------------------------------------------------ the launchers


def stats_size(k: Tensor) -> int:
    """Chunks of keys :func:`kv_stats` reduces separately."""
    return triton.cdiv(k.shape[2], _CHUNK)


def kv_stats(k: Tensor, v: Tensor) -> Tensor:
    """(B, Hkv, S, 3 d + 2) fp32 partial ranges of K and V per chunk of keys."""
    B, Hkv, Lk, d = k.shape
    S = stats_size(k)
    stats = torch.empty(B, Hkv, S, 3 * d + 2, device=k.device, dtype=_F32)
    kr, vr = readable(k), readable(v)
    kv_stats_kernel[(S, B * Hkv)](kr, vr, stats, Hkv, Lk, d, S, *kr.stride(), *vr.stride(),
                           CH=_CHUNK, BN=_BN, BD=block_d(d))  # fmt: skip
    return stats


def fwd_consts(q: Tensor, out: Tensor, Lk: int, scale: float, tol: float) -> dict[str, float]:
    """The forward checks' constants, as the reference derives them."""
    d = q.shape[-1]
    eps = torch.finfo(out.dtype).eps
    return {"scale_abs": abs(scale), "logn": math.log(max(Lk, 1)),
            "tol_rel": tol * (d + 4) * EPS32, "tol_abs": tol * 1e-3,
            "hull_rel": tol * (4 * eps + Lk * EPS32),
            "hull_abs": tol * underflow_floor(out.dtype, length=1, inner=Lk)}  # fmt: skip


def fwd_verify(q: Tensor, k: Tensor, out: Tensor, lse: Tensor, stats: Tensor, rowmax: Tensor,
               scale: float, tol: float) -> Tensor:  # fmt: skip
    """The forward's flags and counts per block of query rows (an int32 scratch for
    :func:`fwd_repair`; its last 4 entries, zeroed, are the records' claims)."""
    B, H, L, d = q.shape
    Hkv, S = stats.shape[1], stats.shape[2]
    nM = triton.cdiv(L, _BM)
    flags = torch.empty(3 * B * H * nM + 4, device=q.device, dtype=torch.int32)
    qr, orr = readable(q), readable(out)
    rmx = row_view(rowmax, q)
    c = fwd_consts(q, out, k.shape[2], scale, tol)
    fwd_verify_kernel[(nM, B * H)](qr, orr, lse, stats, rmx, flags, H, H // Hkv, L, d, S, nM,
                                   *qr.stride(), *orr.stride(), *lse.stride(), *rmx.stride(), **c,
                                   BM=_BM, BD=block_d(d))  # fmt: skip
    return flags


def fwd_repair(q, k, v, mask, out, lse, stats, rowmax, flags, log, step, rows, causal: bool,
               scale: float, tol: float) -> None:  # fmt: skip
    """Recompute the flagged heads' O and LSE in place, their records into ``log`` rows
    ``rows`` (scores, context; -1: none): nothing on a clean call."""
    B, H, L, d = q.shape
    Hkv, Lk, S = k.shape[1], k.shape[2], stats.shape[2]
    nM = triton.cdiv(L, _BM)
    qr, kr, vr, orr = (readable(t) for t in (q, k, v, out))
    m, sm, has_mask = mask_view(mask, q, Lk)
    rmx = row_view(rowmax, q)
    c = fwd_consts(q, out, Lk, scale, tol)
    fwd_repair_kernel[(B * H,)](
        qr, kr, vr, m, orr, lse, stats, rmx, flags, log, step, rows[0], rows[1],
        H, H // Hkv, L, Lk, d, S, nM, *qr.stride(), *kr.stride(), *vr.stride(), *sm,
        *orr.stride(), *lse.stride(), *rmx.stride(), scale, c["scale_abs"], c["logn"],
        c["tol_rel"], c["tol_abs"], c["hull_rel"], c["hull_abs"],
        HAS_MASK=has_mask, CAUSAL=causal, IEEE=use_ieee(q), BM=_BM, BN=16, BD=block_d(d),
        num_warps=8,  # (a rare path: small key tiles, more warps, no spill)
    )  # fmt: skip
    if orr is not out:  # the interpreter's fp32 copy
        out.copy_(orr)


# ------------------------------------------------------------------------ the registered ops
# The Triton family of the SDPA route's check ops (schemas: sdpa_check.SCHEMAS), each one launch;
# their fakes give the scratch these kernels exchange. The verify records nothing: the repair
# does, on a flag.


def _fwd_verify_op(q, k, out, lse, stats, log, step, rows, scale, rowmax, tol):
    return fwd_verify(q, k, out, lse, stats, rowmax, scale, tol)


def _fwd_repair_op(q, k, v, mask, out, lse, stats, flags, log, step, rows, causal, scale, rowmax,
                   tol):  # fmt: skip
    fwd_repair(q, k, v, mask, out, lse, stats, rowmax, flags, log, step, rows, causal, scale, tol)


kv_stats_op = define("sdpa_kv_stats", kv_stats, lambda k, v: k.new_empty(
    k.shape[0], k.shape[1], stats_size(k), 3 * k.shape[-1] + 2, dtype=torch.float32),
    suffix="_triton")  # fmt: skip
fwd_verify_op = define("sdpa_fwd_verify", _fwd_verify_op, lambda q, *_: q.new_empty(
    3 * q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], _BM) + 4, dtype=torch.int32),
    suffix="_triton")  # fmt: skip
fwd_repair_op = define("sdpa_fwd_repair", _fwd_repair_op, lambda *_: None, suffix="_triton")
