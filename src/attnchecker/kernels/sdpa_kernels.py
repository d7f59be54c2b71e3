"""The SDPA route's checks as Triton kernels: what :mod:`attnchecker.kernels.sdpa_check`'s torch
reference computes, in eight launches a layer (three here, five in
:mod:`~attnchecker.kernels.sdpa_kernels_bwd`), none of which waits for the host, each gridded
over its data (issue 54: no program streams more than a few hundred kB at Llama-8B widths):
the repairs read the verify kernels' flags on the device and return at once on a clean call.

- ``kv_stats_kernel``: one pass over K and V, partial ranges per chunk of keys (no atomics, no
  zeroing: the consumers reduce the few chunks);
- ``fwd_verify_kernel``: per block of query rows, the LSE bounds and O's range; writes the
  block's entry (flag bits, counts and, on a flag, the worst excess and value of each check and
  O's flagged columns) to a scratch the repair reads;
- ``fwd_repair_kernel``: per block of query rows: returns unless the block flagged; else
  recomputes its O and LSE (online softmax over the keys, the mask and causality as SDPA's),
  checks them again from registers (lost / reproduced), and the first flagged block of each
  check writes that check's record from every block's entry.

Records go straight into the module's log rows (forward) and the records tensor (backward), as
the reference writes them: rows, the union of flagged columns, the delivered value at the worst
excess (NaN first). Nothing a kernel writes depends on the order its programs run in (the
tests re-run them in other orders: :func:`attnchecker.kernels.launches.program_order`). The
helpers both files use (tiles, the reduced stats, the records, scores of a block) are
:mod:`~attnchecker.kernels.triton_utils`'.

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
from attnchecker.kernels import DEAD, SDPA_BLOCKS, sdpa_check
from attnchecker.kernels.launches import host_flag
from attnchecker.kernels.sdpa_check import define, reduce_stats
from attnchecker.kernels.triton_utils import (
    EPS32,
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
    words,
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
def _fwd_bad(q, lse, rmx, o, rm, dm, lo, hi, kn, scale_abs, logn, tol_rel, tol_abs, hull_rel,
             hull_abs):  # fmt: skip
    """(lse_bad (BM,), its excess, o_bad (BM, BD), its excess) of a block of rows' values."""
    live = (rmx > _DEAD) & rm
    m = tl.where(live, rmx, 0.0)
    r = scale_abs * tl.sqrt(tl.sum(q * q, 1)) * kn
    slack = r * tol_rel + tol_abs
    exc = tl.maximum(lse - (m + r + logn + slack), (m - r - slack) - lse)
    lse_bad = ~(exc <= 0.0) & live
    t = hull_rel * tl.maximum(tl.abs(lo), tl.abs(hi)) + hull_abs
    oexc = tl.maximum(o - (hi + t)[None, :], (lo - t)[None, :] - o)
    o_bad = ~(oexc <= 0.0) & live[:, None] & dm[None, :]
    return lse_bad, exc, o_bad, oexc


@triton.jit
def _worst(values, excess, bad):
    """(the largest excess among the flagged, NaN first; the delivered value there) of a
    block, flattened: the reference's choice (``sdpa_check._worst``), first index on a tie."""
    key = tl.where(bad, tl.where(excess != excess, float("inf"), excess), -float("inf"))
    at = tl.argmax(key, 0)
    pick = tl.arange(0, key.shape[0]) == at
    ex = tl.sum(tl.where(pick, excess, 0.0), 0)
    return tl.where(tl.max(tl.where(pick, excess != excess, False).to(tl.int32), 0) > 0,
                    float("nan"), ex), tl.sum(tl.where(pick, values, 0.0), 0)  # fmt: skip


@triton.jit
def fwd_verify_kernel(Q, Out, LSE, STATS, RMX, FLAGS, H, rep, L, d, S, nM, FW,
                      sq_b, sq_h, sq_l, sq_d, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                      sr_b, sr_h, sr_l, scale_abs, logn, tol_rel, tol_abs, hull_rel, hull_abs,
                      drop_c, BM: tl.constexpr, BD: tl.constexpr,
                      DROP: tl.constexpr):  # fmt: skip
    """Per block of query rows, its entry of FLAGS (FW int32s: :func:`entry_width`): the flag
    bits, the flagged LSE rows and O rows, and on a flag the worst excess and delivered value
    of each (fp32 bits) and O's flagged columns (16 a word). ``DROP``: attention dropout, O in
    ``drop_c`` (1 / (1 - p)) times the hull of V's range and 0."""
    pm, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    ds = tl.arange(0, BD)
    dm = ds < d
    lo, hi, _, kn, _ = head_stats(STATS, b * (H // rep) + h // rep, S, d, ds, dm)
    if DROP:
        lo = tl.minimum(lo, 0.0) * drop_c
        hi = tl.maximum(hi, 0.0) * drop_c
    rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rm = rows < L
    q = tile(Q + b * sq_b + h * sq_h, rows, ds, sq_l, sq_d, rm, dm).to(tl.float32)
    lse = tl.load(LSE + b * sl_b + h * sl_h + rows * sl_l, mask=rm, other=0.0)
    rmx = tl.load(RMX + b * sr_b + h * sr_h + rows * sr_l, mask=rm, other=_DEAD)
    o = tile(Out + b * so_b + h * so_h, rows, ds, so_l, so_d, rm, dm).to(tl.float32)
    lse_bad, exc, o_bad, oexc = _fwd_bad(q, lse, rmx, o, rm, dm, lo, hi, kn, scale_abs, logn,
                                         tol_rel, tol_abs, hull_rel, hull_abs)  # fmt: skip
    n_l = tl.sum(lse_bad.to(tl.int32), 0)
    n_o = tl.sum(tl.max(o_bad.to(tl.int32), 1), 0)
    at = FLAGS + FW * (bh.to(tl.int64) * nM + pm)
    tl.store(at, (n_l > 0).to(tl.int32) | ((n_o > 0).to(tl.int32) << 1))
    tl.store(at + 1, n_l)
    tl.store(at + 2, n_o)
    # where, and what was delivered (0 on a clean block: every byte of the entry written)
    ex_l, v_l = _worst(lse, exc, lse_bad)
    ex_o, v_o = _worst(tl.reshape(o, [BM * BD]), tl.reshape(oexc, [BM * BD]),
                       tl.reshape(o_bad, [BM * BD]))  # fmt: skip
    tl.store(at + 3, tl.where(n_l > 0, ex_l, 0.0).to(tl.int32, bitcast=True))
    tl.store(at + 4, tl.where(n_l > 0, v_l, 0.0).to(tl.int32, bitcast=True))
    tl.store(at + 5, tl.where(n_o > 0, ex_o, 0.0).to(tl.int32, bitcast=True))
    tl.store(at + 6, tl.where(n_o > 0, v_o, 0.0).to(tl.int32, bitcast=True))
    tl.store(at + 7 + tl.arange(0, BD // 16), words(tl.max(o_bad.to(tl.int32), 0), BD))
    if (pm == 0) & (bh == 0):  # the records' claims, for the repair
        claims = FLAGS + FW * (tl.num_programs(1).to(tl.int64) * nM) + tl.arange(0, 4)
        tl.store(claims, tl.zeros([4], dtype=tl.int32))


@triton.jit
def _summary(FLAGS, n, FW, field, bit, BLOCK: tl.constexpr, BD: tl.constexpr):
    """Over the n entries of FLAGS whose flag has ``bit``: (the first such entry, the count at
    ``field`` summed, the worst excess's delivered value (NaN first, then the largest, then the
    first), O's flagged columns' union counted). On a flag only: a few vector loads."""
    first = tl.full([], 2**31 - 1, tl.int64)
    count = tl.zeros([], dtype=tl.int32)
    best = tl.full([], -float("inf"), tl.float32)
    value = tl.zeros([], dtype=tl.float32)
    cols = tl.zeros([BD // 16], dtype=tl.int32)
    for e0 in range(0, n, BLOCK):
        es = (e0 + tl.arange(0, BLOCK)).to(tl.int64)
        at = FLAGS + es * FW
        hit = ((tl.load(at, mask=es < n, other=0) & bit) != 0) & (es < n)
        first = tl.minimum(first, tl.min(tl.where(hit, es, 2**31 - 1), 0))
        count += tl.sum(tl.load(at + field, mask=hit, other=0), 0)
        off = 3 if bit == 1 else 5
        ex = tl.load(at + off, mask=hit, other=0).to(tl.float32, bitcast=True)
        key = tl.where(hit, tl.where(ex != ex, float("inf"), ex), -float("inf"))
        if tl.max(key, 0) > best:  # (strictly: the first block keeps a tie)
            best = tl.max(key, 0)
            pick = es == tl.argmax(key, 0) + e0
            value = tl.sum(tl.where(pick, tl.load(at + off + 1, mask=hit, other=0).to(
                tl.float32, bitcast=True), 0.0), 0)  # fmt: skip
        cols = cols | tl.reduce(tl.load(at[:, None] + 7 + tl.arange(0, BD // 16)[None, :],
                                        mask=hit[:, None], other=0), 0, _or)  # fmt: skip
    return first, count, value, tl.sum(popcount16(cols), 0)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def fwd_repair_kernel(Q, K, V, M, Out, LSE, STATS, RMX, FLAGS, LOG, STEP, row_s, row_c,
                      H, rep, L, Lk, d, S, nM, FW,
                      sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_l, sk_d, sv_b, sv_h, sv_l, sv_d,
                      sm_b, sm_h, sm_l, sm_k, so_b, so_h, so_l, so_d, sl_b, sl_h, sl_l,
                      sr_b, sr_h, sr_l, scale, scale_abs, logn, tol_rel, tol_abs, hull_rel,
                      hull_abs,
                      HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr):  # fmt: skip
    """Per block of query rows (as the verify): one load of its flag, and on a flag the block's
    O and LSE recomputed (online softmax over the keys) and checked again from registers
    (lost and reproduced where still flagged); the first flagged block of each check writes
    its record from every block's entry (the reference's record: nothing depends on which
    program runs first)."""
    pm, bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    me = bh * nM + pm
    f = tl.load(FLAGS + FW * me)
    if f != 0:  # the device flag: nothing below runs for a clean block
        b, h = bh // H, bh % H
        hkv = h // rep
        ds = tl.arange(0, BD)
        dm = ds < d
        lo, hi, _, kn, _ = head_stats(STATS, b * (H // rep) + hkv, S, d, ds, dm)
        Oh, Lh = Out + b * so_b + h * so_h, LSE + b * sl_b + h * sl_h
        Kh, Vh = K + b * sk_b + hkv * sk_h, V + b * sv_b + hkv * sv_h
        Mh = M + b * sm_b + h * sm_h
        rows = (pm * BM + tl.arange(0, BM)).to(tl.int64)
        rm = rows < L
        q = tile(Q + b * sq_b + h * sq_h, rows, ds, sq_l, sq_d, rm, dm)
        m_i = tl.full([BM], -float("inf"), tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        end = Lk
        if CAUSAL:
            end = tl.minimum(Lk, (pm + 1) * BM)
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
        o = tl.where(l_i[:, None] > 0, acc / l_safe[:, None], 0.0).to(Out.dtype.element_ty)
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), 0.0)
        tl.store(Oh + rows[:, None] * so_l + ds[None, :] * so_d, o, mask=rm[:, None] & dm[None, :])
        tl.store(Lh + rows * sl_l, lse, mask=rm)
        # checked again as delivered, from registers (no reload of what other warps stored)
        rmx = tl.load(RMX + b * sr_b + h * sr_h + rows * sr_l, mask=rm, other=_DEAD)
        lse_bad, _e, o_bad, _oe = _fwd_bad(q.to(tl.float32), lse, rmx, o.to(tl.float32), rm, dm,
                                           lo, hi, kn, scale_abs, logn, tol_rel, tol_abs,
                                           hull_rel, hull_abs)  # fmt: skip
        claims = FLAGS + FW * tl.num_programs(1).to(tl.int64) * nM
        if tl.sum(lse_bad.to(tl.int32), 0) > 0:
            mark_lost(LOG, row_s, claims + 2)
        if tl.sum(tl.max(o_bad.to(tl.int32), 1), 0) > 0:
            mark_lost(LOG, row_c, claims + 3)
        n = tl.num_programs(1).to(tl.int64) * nM
        step = tl.load(STEP)
        if (f & 1) != 0:
            first, n_l, v_l, _c = _summary(FLAGS, n, FW, 1, 1, 256, BD)
            if first == me:
                add_record(LOG, row_s, n_l, tl.zeros([], dtype=tl.int32), v_l, step)
        if (f & 2) != 0:
            first, n_o, v_o, n_c = _summary(FLAGS, n, FW, 2, 2, 256, BD)
            if first == me:
                add_record(LOG, row_c, n_o, n_c, v_o, step)


# ------------------------------------------------------------------------------ the launchers


def entry_width(d: int) -> int:
    """int32s of a block's entry in the forward's flags: bits, 2 counts, 2 (excess, value)
    pairs, a word per 16 features."""
    return 7 + block_d(d) // 16


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
               scale: float, tol: float, dropout: float = 0.0) -> Tensor:  # fmt: skip
    """The forward's flags and counts per block of query rows (an int32 scratch for
    :func:`fwd_repair`; its last 4 entries, zeroed, are the records' claims); ``dropout``: the
    call's attention dropout (O's range widened)."""
    B, H, L, d = q.shape
    Hkv, S = stats.shape[1], stats.shape[2]
    nM, FW = triton.cdiv(L, _BM), entry_width(d)
    flags = torch.empty(FW * B * H * nM + 4, device=q.device, dtype=torch.int32)
    qr, orr = readable(q), readable(out)
    rmx = row_view(rowmax, q)
    c = fwd_consts(q, out, k.shape[2], scale, tol)
    fwd_verify_kernel[(nM, B * H)](qr, orr, lse, stats, rmx, flags, H, H // Hkv, L, d, S, nM, FW,
                                   *qr.stride(), *orr.stride(), *lse.stride(), *rmx.stride(), **c,
                                   drop_c=1 / (1 - dropout), BM=_BM, BD=block_d(d),
                                   DROP=dropout > 0)  # fmt: skip
    return flags


def flagged(flags: Tensor, d: int) -> bool:
    """Whether :func:`fwd_verify`'s scratch holds a flag, read on the host (a dropout call's
    repair: a synchronisation on CUDA; :func:`~attnchecker.kernels.launches.host_flag`)."""
    return host_flag(flags[:-4].view(-1, entry_width(d))[:, 0])


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
    fwd_repair_kernel[(nM, B * H)](
        qr, kr, vr, m, orr, lse, stats, rmx, flags, log, step, rows[0], rows[1],
        H, H // Hkv, L, Lk, d, S, nM, entry_width(d), *qr.stride(), *kr.stride(), *vr.stride(), *sm,
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


def _fwd_verify_op(q, k, out, lse, stats, log, step, rows, scale, rowmax, tol, dropout=0.0):
    return fwd_verify(q, k, out, lse, stats, rowmax, scale, tol, dropout)


def _fwd_repair_op(q, k, v, mask, out, lse, stats, flags, log, step, rows, causal, scale, rowmax,
                   tol, dropout=0.0, rng=None):  # fmt: skip
    if dropout > 0:  # the kernel's draw is not the repair kernel's: the reference's, on a flag
        if flagged(flags, q.shape[-1]):
            stats = reduce_stats(stats)
            bad = sdpa_check.fwd_verify(q, k, out, lse, stats, log, step, tuple(rows), scale,
                                        rowmax, tol, dropout)  # fmt: skip
            sdpa_check.fwd_repair(q, k, v, mask, out, lse, stats, bad, log, tuple(rows), causal,
                                  scale, rowmax, tol, dropout, rng)  # fmt: skip
        return
    fwd_repair(q, k, v, mask, out, lse, stats, rowmax, flags, log, step, rows, causal, scale, tol)


kv_stats_op = define("sdpa_kv_stats", kv_stats, lambda k, v: k.new_empty(
    k.shape[0], k.shape[1], stats_size(k), 3 * k.shape[-1] + 2, dtype=torch.float32),
    suffix="_triton")  # fmt: skip
fwd_verify_op = define("sdpa_fwd_verify", _fwd_verify_op, lambda q, *_: q.new_empty(
    entry_width(q.shape[-1]) * q.shape[0] * q.shape[1] * triton.cdiv(q.shape[2], _BM) + 4,
    dtype=torch.int32),
    suffix="_triton")  # fmt: skip
fwd_repair_op = define("sdpa_fwd_repair", _fwd_repair_op, lambda *_: None, suffix="_triton")
