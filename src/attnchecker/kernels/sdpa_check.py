"""The SDPA route's checks (``backend="sdpa"``): the backend's own attention kernel, checked by
what it returns, as registered ops.

The core runs the aten op that ``F.scaled_dot_product_attention`` runs (the CPU flash kernel; on
CUDA the flash kernel, or the memory-efficient one where a mask is given), because those return
each row's log-sum-exp. Nothing of size L x L is made. What holds exactly for any mask and any
backend, per (batch, head), q_i / k_j / v_j rows, P the softmax, n the key count (attention
dropout with probability p: :ref:`below <dropout>`):

- **scores** (forward): max_j (scale s_ij + m_ij) <= LSE_i <= max_j (scale s_ij + m_ij) + log n,
  and |scale s_ij| <= r_i = |scale| ||q_i|| max_j ||k_j||, so m_i - r_i <= LSE_i <= m_i + r_i +
  log n (m_i: the row's largest mask value). An INF, NaN or near-INF score (any finite one above
  the bound), or a whole row sunk, breaks it; a single score lowered (-INF) does not. A bound,
  not a checksum: extreme errors only.
- **context** (forward): O_i = sum_j p_ij v_j with p_ij >= 0 and sum_j p_ij = 1 for a row that
  attends a key (rows that attend none, :data:`~attnchecker.kernels.DEAD`, are not checked), so
  each O_if lies in [min_j v_jf, max_j v_jf]. Extreme errors only (a fault in P or in the P V
  product that leaves O inside V's range is not seen).
- **dv** (backward): sum_j dV_j = sum_i (sum_j p_ij) dO_i = sum_i dO_i over the rows that attend
  to a key. A checksum: any error above its (column sum's) rounding bound.
- **dk** (backward): sum_j dK_j = scale sum_i (sum_j dS_ij) q_i = 0 (each row of
  dS = P o (dP - D) sums to 0). A checksum: any error in dK, dS or dP above its bound (built
  from dS's bound: loose, extreme errors only in half precision; docs/gpu.md).
- **dq** (backward): |dQ_if| <= scale sum_j |dS_ij| |k_jf| <= 2 scale ||dO_i||_1 max|V| max_j |k_jf|
  (sum_j |dS_ij| <= sum_j p_ij (|dP_ij| + |D_i|) <= 2 max_j |dP_ij|). A bound: extreme errors.

.. _dropout:

**Attention dropout** (training, probability p; c = 1 / (1 - p)): the kernel multiplies P by a
mask Z / (1 - p) it draws (Z in {0, 1}) before V, so O_i = sum_j w_ij v_j with w_ij = c z_ij p_ij
>= 0 and sum_j w_ij in [0, c]. The LSE is the undropped softmax's: its bound holds as is. O_if
lies in [c min(0, min_j v_jf), c max(0, max_j v_jf)]. dK's sum stays an identity (sum_j dS_ij =
sum_j p_ij dP_ij - D_i = 0, D_i = dO_i . O_i = sum_j p_ij dP_ij with dP = c Z o (dO V^T));
dV's sum is sum_i (sum_j w_ij) dO_i, so it lies in [c sum_i min(0, dO_i), c sum_i max(0, dO_i)]
(a range: extreme errors only); dQ's and dK's bounds take c (|dP| <= c ||dO_i||_1 max|V|). The
draw is the backend's and lives inside its kernel: a repair reruns the whole call with the
generator rewound to its state before the call (the same seed and offset, so the same Z, on
CUDA and on a CPU), and a CPU's backward reruns its math forward so (:func:`attention_backward`).
The repairs of a dropout call read their flags on the host (the Triton family's verify kernels
take the dropout; on a flag, this reference checks again, writes the records and repairs: the
Triton repairs cannot draw the kernel's Z): one synchronisation a repair op (issue 54).

Tolerances (derived where they are computed) are in units of the operands' ``finfo.eps`` and of
fp32 accumulation, times ``tolerance_scale``.

A flagged (batch, head) is recomputed from the operands (forward: O and the LSE; backward: the
whole K/V head group's dQ, dK, dV), written in place, checked again: still flagged is
``reproduced`` and ``lost`` (the operands imply it). The repair is a second op that does nothing
on a clean call. The records go straight into the module's log rows (forward) and into a (n ops,
7) records tensor returned as the backward's sink gradient.

The functions below are the torch reference; the registered ops at the end run either it (a
CPU's default: the repair reads its flag on the host, which costs nothing there) or, with
``kernels``, the Triton kernels of :mod:`attnchecker.kernels.sdpa_kernels` (CUDA's default,
``check_impl="auto"``, and the interpreter in tests), whose repairs read their flags on the
device: no host synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnchecker.abft.tolerance import underflow_floor
from attnchecker.kernels import DEAD
from attnchecker.kernels.launches import host_flag
from attnchecker.kernels.sdpa_backend import (
    attention_backward,
    attention_forward,
    expand_kv,
    group_sum,
    rewound,
)

__all__ = [
    "REFERENCE",
    "SCHEMAS",
    "SdpaOps",
    "bwd_repair",
    "bwd_verify",
    "fwd_repair",
    "fwd_verify",
    "kv_stats",
    "mask_facts",
]

_F32 = torch.float32
_EPS32 = torch.finfo(_F32).eps
_LOSE, _REPRO = 3, 4  # RECORD_FIELDS' lost, reproduced
_aten = torch.ops.aten


# --------------------------------------------------------------------------------- the checks


def mask_facts(mask: Tensor | None, L: int) -> Tensor:
    """Each query row's largest mask value, (B | 1, H | 1, L | 1) fp32 (0 without a mask; a bool
    mask's True is 0, False -inf): what the LSE bounds add, and :data:`DEAD` rows. The caller
    computes it once per mask and step (one pass over a mask the backend reads anyway)."""
    if mask is None:
        return torch.zeros(1, 1, 1, dtype=_F32)
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=_F32, device=mask.device).masked_fill(
            ~mask.any(-1), -math.inf)  # fmt: skip
    return mask.float().amax(-1)


def kv_stats(k: Tensor, v: Tensor) -> Tensor:
    """(B, Hkv, 3 d + 2) fp32 per kv head: [min_j v_jf (d), max_j v_jf (d), max_j |k_jf| (d),
    max_j ||k_j||, max_jf |v_jf|]: what the forward and the backward checks bound with (K and V
    are read once a forward)."""
    kf, vf = k.float(), v.float()
    return torch.cat(
        [vf.amin(2), vf.amax(2), kf.abs().amax(2), torch.linalg.vector_norm(kf, dim=-1).amax(2,
         keepdim=True), vf.abs().amax((2, 3))[..., None]], -1
    )  # fmt: skip


def _worst(values: Tensor, excess: Tensor) -> Tensor:
    """The delivered value where ``excess`` is largest (NaN first), 0-dim fp64."""
    flat_e, flat_v = excess.reshape(-1), values.reshape(-1).to(torch.float64)
    key = torch.where(flat_e.isnan(), torch.inf, flat_e)
    return flat_v.gather(0, key.argmax().reshape(1))[0]  # (no data-dependent shape)


def _record(
    log: Tensor, row: int, bad: Tensor, n_cols: Tensor, value: Tensor, step: Tensor
) -> None:
    """Add one check's record (n_rows, n_cols, value, -, -, detected, step) to ``log[row]``."""
    n_rows = bad.sum().to(torch.float64)
    det = (n_rows > 0).to(torch.float64)
    zero, at = det * 0, det * step.to(torch.float64).reshape(())
    value = torch.where(det > 0, value, 0.0)
    log[row].add_(torch.stack([n_rows, n_cols.to(torch.float64) * det, value, zero, zero, det, at]))


def _fwd_flags(q, k, out, lse, stats, scale, rowmax, tol, dropout=0.0):
    """(lse_bad (B, H, L), o_bad (B, H, L, d), lse excess, o excess) of the forward checks."""
    H, d, Lk = q.shape[1], q.shape[3], k.shape[2]
    st = expand_kv(stats, H)[:, :, None]  # (B, H, 1, 3d + 2)
    lo, hi, knorm = st[..., :d], st[..., d : 2 * d], st[..., 3 * d]
    if dropout > 0:  # weights c z_ij p_ij: O in the hull of c V's range and 0
        c = 1 / (1 - dropout)
        lo, hi = c * lo.clamp(max=0), c * hi.clamp(min=0)
    rowmax = rowmax.to(q.device)
    live = rowmax > DEAD  # (B | 1, H | 1, L | 1)
    m = torch.where(live, rowmax, 0.0)
    # max_j (scale s_ij + m_ij) <= LSE_i <= max_j (scale s_ij + m_ij) + log n, and
    # |scale s_ij| <= r_i = |scale| ||q_i|| max_j ||k_j||, so m_i - r_i <= LSE_i <= m_i + r_i +
    # log n (m_i: the row's largest mask value, attained by some key). The scores' fp32
    # accumulation over d exact products stays within d eps32 of r_i; 1e-3 absolute covers the
    # kernel's exp and log
    r = abs(scale) * torch.linalg.vector_norm(q.float(), dim=-1) * knorm
    slack = r * tol * (d + 4) * _EPS32 + tol * 1e-3
    lse_excess = torch.maximum(lse - (m + r + math.log(max(Lk, 1)) + slack), (m - r - slack) - lse)
    lse_bad = ~(lse_excess <= 0) & live
    # a row that attends a key: O_if in [lo_f, hi_f] (a convex combination). The products p v in
    # the kernel's precision (P rounded to the operands' dtype for the MMA, sum p~ within eps of
    # 1), the output rounded once, fp32 accumulation over Lk terms: (4 eps + Lk eps32) max|v_f|
    # covers them all
    eps = torch.finfo(out.dtype).eps
    t = tol * ((4 * eps + Lk * _EPS32) * torch.maximum(lo.abs(), hi.abs())
               + underflow_floor(out.dtype, length=1, inner=Lk))  # fmt: skip
    o = out.float()
    o_excess = torch.maximum(o - (hi + t), (lo - t) - o)
    o_bad = ~(o_excess <= 0) & live[..., None]
    return lse_bad, o_bad, lse_excess, o_excess


def fwd_verify(
    q: Tensor, k: Tensor, out: Tensor, lse: Tensor, stats: Tensor, log: Tensor, step: Tensor,
    rows: tuple[int, int], scale: float, rowmax: Tensor, tol: float, dropout: float = 0.0,
) -> Tensor:  # fmt: skip
    """The forward's checks of one call: records added to ``log`` rows ``rows`` (scores,
    context; -1: not recorded) and the flags (B, H) int32 (bit 1: the LSE bound, bit 2: the
    context's range) that :func:`fwd_repair` reads."""
    lse_bad, o_bad, lse_ex, o_ex = _fwd_flags(q, k, out, lse, stats, scale, rowmax, tol, dropout)
    if rows[0] >= 0:
        _record(log, rows[0], lse_bad, torch.zeros(()), _worst(lse, lse_ex), step)
    if rows[1] >= 0:
        o_rows = o_bad.any(-1)
        n_cols = o_bad.flatten(0, 2).any(0).sum()
        _record(log, rows[1], o_rows, n_cols, _worst(out, o_ex), step)
    return lse_bad.any(-1).int() | (o_bad.any((-1, -2)).int() << 1)


def _full(rows: Tensor, q: Tensor) -> Tensor:
    """Per-row facts (B | 1, H | 1, L | 1) broadcast to q's (B, H, L)."""
    return rows.to(q.device).expand(*q.shape[:3])


def _heads(x: Tensor, b: Tensor, h: Tensor) -> Tensor:
    """x[b, h] of (batch, head) pairs as one batch of heads (1, n, ...); a broadcast (size-1)
    batch or head dimension is indexed at 0."""
    b = b if x.shape[0] > 1 else torch.zeros_like(b)
    h = h if x.shape[1] > 1 else torch.zeros_like(h)
    return x[b, h][None]


def fwd_repair(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    stats: Tensor, flags: Tensor, log: Tensor, rows: tuple[int, int], causal: bool,
    scale: float, rowmax: Tensor, tol: float, dropout: float = 0.0, rng: Tensor | None = None,
) -> None:  # fmt: skip
    """Recompute the flagged (batch, head) outputs and LSEs in place; those still flagged are
    lost and reproduced in the rows of the checks that flagged them. Nothing on a clean call.
    With ``dropout``, the whole call rerun from ``rng`` (the kernel's draw follows the heads'
    places in the call: a sub-batch would draw other masks)."""
    if not host_flag(flags):  # (CPU: no device to wait for; CUDA: a synchronisation)
        return
    b, h = flags.nonzero(as_tuple=True)
    rep = q.shape[1] // k.shape[1]
    sub = [_heads(q, b, h), _heads(k, b, h // rep), _heads(v, b, h // rep)]
    if dropout > 0:
        with rewound(rng, q.device):
            whole = attention_forward(q, k, v, mask, causal, scale, dropout)
        new_out, new_lse = whole[0][b, h][None], whole[1][b, h][None]
    else:
        m = None if mask is None else _heads(mask, b, h)
        new_out, new_lse, _ = attention_forward(*sub, m, causal, scale)
    out[b, h], lse[b, h] = new_out[0], new_lse[0]
    again = fwd_verify(sub[0], sub[1], new_out, new_lse, stats[b, h // rep][None],
                       log.new_zeros(2, 7), log.new_zeros(1), (-1, -1), scale,
                       _heads(_full(rowmax, q), b, h), tol, dropout)  # fmt: skip
    for bit, row in ((1, rows[0]), (2, rows[1])):
        if row >= 0 and bool((again & bit).any()):
            log[row, _LOSE] += 1
            log[row, _REPRO] += 1


def _bwd_flags(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, scale, tol, dropout=0.0):
    """(dq_bad (B, H, L, d), dk_bad (B, Hkv, d), dv_bad (B, Hkv, d), excesses) of the backward
    checks."""
    c = 1 / (1 - dropout)  # dropout: the weights c z p sum to at most c
    H, L, d = q.shape[1:]
    Hkv, Lk = k.shape[1], k.shape[2]
    eps = torch.finfo(q.dtype).eps
    g = grad.float()
    dead = _full(rowmax, q) <= DEAD
    live = (~dead).float()[..., None]  # (B, H, L, 1)
    lse_abs = torch.where(dead, 0.0, lse.abs()).nan_to_num(0.0, 0.0, 0.0)[..., None]

    # The tolerances are bounds predicted from the operands, never from the delivered dK / dV
    # (a whole column scaled by a fault would scale such a tolerance with it).
    # dV: sum_j dV_j = sum_i live_i dO_i. Error terms per row i: P rounded to the operands'
    # dtype for the MMA (eps), fp32 accumulation over L + Lk (the P^T dO sum and P's own
    # normaliser), P recomputed as exp(s - LSE) with the LSE rounded (eps32 |LSE_i|), and the
    # key rows dV_j rounded to the output dtype (eps sum_j |dV_jf| <= eps sum_i |dO_if|). A dead
    # row adds up to Lk |dO_i| (P of ones).
    acc = (L + Lk) * _EPS32
    w = live * (2 * eps + acc + _EPS32 * lse_abs) + (1 - live) * Lk  # (B, H, L, 1)
    # each dV_j rounded to the output dtype loses up to a subnormal spacing where it underflows
    # (fp16 gradients without a loss scale: ~1e-5), which no relative term covers
    t_v = (
        tol
        * 4
        * (c * group_sum((w * g.abs()).sum(2), Hkv) + underflow_floor(dv.dtype, length=Lk, inner=L))
    )
    sv = dv.float().sum(2)
    if dropout > 0:  # sum_j dV_j = sum_i (sum_j w_ij) dO_i, sum_j w_ij in [0, c]: a range
        lo = c * group_sum((live * g.clamp(max=0)).sum(2), Hkv)
        hi = c * group_sum((live * g.clamp(min=0)).sum(2), Hkv)
        v_excess = torch.maximum(sv - hi, lo - sv) - t_v
    else:
        v_excess = (sv - group_sum((live * g).sum(2), Hkv)).abs() - t_v  # (B, Hkv, d)
    # dK: sum_j dK_j = 0, and sum_j |dK_jf| <= |scale| sum_i (sum_j |dS_ij|) |q_if| <= 2 |scale|
    # sum_i a_i |q_if| (a_i = ||dO_i||_1 max|V|; Lk a_i on a dead row). Relative to that: dS
    # rounded for the MMA, D_i from the delivered O, dK_j rounded to the output dtype (eps
    # each), the products in fp32 over L + Lk + d terms, P from the rounded LSE
    st = stats[:, :, None]  # (B, Hkv, 1, 3d + 2)
    vabs = expand_kv(st[..., 3 * d + 1], H)  # (B, H, 1)
    a = c * g.abs().sum(-1) * vabs * (live[..., 0] + (1 - live[..., 0]) * Lk)  # (B, H, L)
    qa = group_sum((a[..., None] * q.float().abs()).sum(2), Hkv)  # (B, Hkv, d)
    c = 4 * eps + (L + Lk + d) * _EPS32 + _EPS32 * lse_abs.amax((1, 2, 3))[:, None, None]
    t_k = tol * 4 * (c * abs(scale) * 2 * qa + underflow_floor(dk.dtype, length=Lk, inner=L))
    k_excess = dk.float().sum(2).abs() - t_k
    # dQ: |dQ_if| <= 2 |scale| a_i max_j |k_jf|, the same terms relative to it
    kabs = expand_kv(st[..., 2 * d : 3 * d], H)  # (B, H, 1, d)
    c_q = 1 + tol * 4 * (3 * eps + (Lk + d) * _EPS32)
    q_excess = dq.float().abs() - (
        c_q * 2 * abs(scale) * a[..., None] * kabs
        + tol * 4 * underflow_floor(dq.dtype, length=1, inner=Lk)
    )
    bad = [~(x <= 0) for x in (q_excess, k_excess, v_excess)]
    return (*bad, q_excess, k_excess, v_excess)


def bwd_verify(
    q: Tensor, k: Tensor, v: Tensor, lse: Tensor, grad: Tensor, dq: Tensor, dk: Tensor,
    dv: Tensor, stats: Tensor, rowmax: Tensor, rec: Tensor, step: Tensor,
    rows: tuple[int, int, int],
    scale: float, tol: float, dropout: float = 0.0,
) -> Tensor:  # fmt: skip
    """The backward's checks of one call: records added to ``rec`` rows ``rows`` (dq, dk, dv;
    -1: not recorded) and the flags (B, Hkv) int32 (bits 1, 2, 4: dq, dk, dv) of each K/V head
    group, which :func:`bwd_repair` reads."""
    q_bad, k_bad, v_bad, q_ex, k_ex, v_ex = _bwd_flags(q, k, v, lse, grad, dq, dk, dv, stats,
                                                       rowmax, scale, tol, dropout)  # fmt: skip
    B, Hkv = k.shape[:2]
    if rows[0] >= 0:
        _record(rec, rows[0], q_bad.any(-1), q_bad.flatten(0, 2).any(0).sum(),
                _worst(dq, q_ex), step)  # fmt: skip
    for row, bad, ex, t in ((rows[1], k_bad, k_ex, dk), (rows[2], v_bad, v_ex, dv)):
        if row >= 0:  # key rows are not told apart by a column sum: the flagged columns
            _record(rec, row, bad.any(-1), bad.flatten(0, 1).any(0).sum(), _worst(t.sum(2), ex),
                    step)  # fmt: skip
    q_group = q_bad.any((-1, -2)).view(B, Hkv, -1).any(-1)
    return q_group.int() | (k_bad.any(-1).int() << 1) | (v_bad.any(-1).int() << 2)


def bwd_repair(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    grad: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, stats: Tensor, rowmax: Tensor,
    flags: Tensor, rec: Tensor, rows: tuple[int, int, int], causal: bool, scale: float,
    tol: float, dropout: float = 0.0, rng: Tensor | None = None,
) -> None:  # fmt: skip
    """Recompute dQ, dK and dV of the flagged K/V head groups in place (every query head of a
    group), check them again, and mark the still flagged lost and reproduced. Nothing on a clean
    call. With ``dropout``, the whole call's backward from the forward's draw (``rng``: the
    generator before the forward)."""
    if not host_flag(flags):
        return
    b, g = flags.nonzero(as_tuple=True)
    rep = q.shape[1] // k.shape[1]
    hq = (g[:, None] * rep + torch.arange(rep, device=g.device)).reshape(-1)  # (n rep,)
    bq = b.repeat_interleave(rep)
    sub_q = [_heads(t, bq, hq) for t in (q, out, grad)]
    sub_lse = lse[bq, hq][None]
    sub_k = [_heads(t, b, g) for t in (k, v)]
    if dropout > 0:
        with torch.no_grad(), rewound(rng, q.device):
            aux = attention_forward(q, k, v, mask, causal, scale, dropout)[2]
        whole = attention_backward(grad, q, k, v, out, lse, mask, causal, scale, aux, dropout, rng)
        new = (whole[0][bq, hq][None], whole[1][b, g][None], whole[2][b, g][None])
    else:
        m = None if mask is None else _heads(mask, bq, hq)
        with torch.no_grad():  # (the CUDA kernels' backward takes their forward's own state)
            aux = attention_forward(sub_q[0], *sub_k, m, causal, scale)[2] if q.is_cuda else ()
            new = attention_backward(sub_q[2], sub_q[0], *sub_k, sub_q[1], sub_lse, m, causal,
                                     scale, aux)  # fmt: skip
    dq[bq, hq], dk[b, g], dv[b, g] = new[0][0], new[1][0], new[2][0]
    again = bwd_verify(sub_q[0], *sub_k, sub_lse, sub_q[2], *new, stats[b, g][None],
                       _heads(_full(rowmax, q), bq, hq),
                       rec.new_zeros(3, 7), rec.new_zeros(1), (-1, -1, -1), scale, tol,
                       dropout)  # fmt: skip
    for bit, row in ((1, rows[0]), (2, rows[1]), (4, rows[2])):
        if row >= 0 and bool((again & bit).any()):
            rec[row, _LOSE] += 1
            rec[row, _REPRO] += 1


# ------------------------------------------------------------------------ the registered ops
# One call, one dispatched op (what a CPU counts as a launch); opaque to torch.compile. Two
# families of one schema each (:data:`SCHEMAS`): the torch reference's, ``attnchecker::sdpa_*``
# (below), and the Triton kernels', ``attnchecker::sdpa_*_triton`` (registered beside the
# kernels, in sdpa_kernels and sdpa_kernels_bwd); the scratch tensors between the ops of a
# family differ, so each op has its own fake.
# Each family is an :class:`SdpaOps` value.

_Q = "Tensor q, Tensor k"
SCHEMAS: dict[str, tuple[str, tuple[str, ...]]] = {
    # name: (schema, mutated arguments)
    "sdpa_kv_stats": ("(Tensor k, Tensor v) -> Tensor", ()),
    "sdpa_fwd_verify": (
        f"({_Q}, Tensor out, Tensor lse, Tensor stats, Tensor(a!) log, Tensor step, int[] rows, "
        "float scale, Tensor rowmax, float tol, float dropout=0.) -> Tensor", ("log",)),
    "sdpa_fwd_repair": (
        f"({_Q}, Tensor v, Tensor? mask, Tensor(a!) out, Tensor(b!) lse, Tensor stats, "
        "Tensor(c!) flags, Tensor(d!) log, Tensor step, int[] rows, bool causal, float scale, "
        "Tensor rowmax, float tol, float dropout=0., Tensor? rng=None) -> ()",
        ("out", "lse", "flags", "log")),
    "sdpa_bwd_verify": (
        f"({_Q}, Tensor v, Tensor lse, Tensor grad, Tensor dq, Tensor dk, Tensor dv, "
        "Tensor stats, Tensor rowmax, Tensor(a!) rec, Tensor step, int[] rows, float scale, "
        "float tol, float dropout=0.) -> (Tensor, Tensor)", ("rec",)),
    "sdpa_bwd_sums": ("(Tensor dk, Tensor dv) -> Tensor", ()),
    "sdpa_bwd_repair": (
        f"({_Q}, Tensor v, Tensor? mask, Tensor out, Tensor lse, Tensor grad, Tensor(a!) dq, "
        "Tensor(b!) dk, Tensor(c!) dv, Tensor stats, Tensor rowmax, Tensor part, "
        "Tensor(d!) flags, Tensor sums, Tensor(e!) rec, Tensor step, int[] rows, bool causal, "
        "float scale, float tol, float dropout=0., Tensor? rng=None) -> ()",
        ("dq", "dk", "dv", "flags", "rec")),
}  # fmt: skip
"""The SDPA route's check ops, one schema for both families: forward, kv_stats (K's and V's
ranges, partial per chunk of keys), fwd_verify (flags, records on the reference's path),
fwd_repair (on a flag); backward, bwd_verify ((partials, flags)), bwd_sums (dK's and dV's column
sums per block of key rows: the kernels'; the reference's is empty), bwd_repair (on a flag). The
kernels' repairs claim the records in the flags' last entries (mutated; found by opcheck:
undeclared before 2026-12-06)."""


def define(name: str, fn, fake, suffix: str = ""):
    """Register ``fn`` as op ``attnchecker::<name><suffix>`` of :data:`SCHEMAS`' ``name``, with
    its fake."""
    schema, mutated = SCHEMAS[name]
    op = torch.library.custom_op(f"attnchecker::{name}{suffix}", fn, mutates_args=mutated,
                                 schema=schema)  # fmt: skip
    op.register_fake(fake)
    return op


@dataclass(frozen=True)
class SdpaOps:
    """One family of the SDPA route's check ops (:data:`SCHEMAS`), in the order a call runs
    them."""

    kv_stats: Callable[..., Tensor]
    fwd_verify: Callable[..., Tensor]
    fwd_repair: Callable[..., None]
    bwd_verify: Callable[..., tuple[Tensor, Tensor]]
    bwd_sums: Callable[..., Tensor]
    bwd_repair: Callable[..., None]


def reduce_stats(stats: Tensor) -> Tensor:
    """(B, Hkv, S, 3 d + 2) partial ranges (S chunks of keys) -> (B, Hkv, 3 d + 2)."""
    if stats.shape[2] == 1:
        return stats[:, :, 0]
    d = (stats.shape[-1] - 2) // 3
    return torch.cat([stats[..., :d].amin(2), stats[..., d:].amax(2)], -1)


def _kv_stats_ref(k, v):
    return kv_stats(k, v)[:, :, None]


def _fwd_verify_ref(q, k, out, lse, stats, log, step, rows, scale, rowmax, tol, dropout=0.0):
    return fwd_verify(q, k, out, lse, reduce_stats(stats), log, step, tuple(rows), scale,
                      rowmax, tol, dropout)  # fmt: skip


def _fwd_repair_ref(q, k, v, mask, out, lse, stats, flags, log, step, rows, causal, scale,
                    rowmax, tol, dropout=0.0, rng=None):  # fmt: skip
    fwd_repair(q, k, v, mask, out, lse, reduce_stats(stats), flags, log, tuple(rows), causal,
               scale, rowmax, tol, dropout, rng)  # fmt: skip


def _bwd_verify_ref(q, k, v, lse, grad, dq, dk, dv, stats, rowmax, rec, step, rows, scale, tol,
                    dropout=0.0):  # fmt: skip
    """(no partials, the whole check's flags (B, Hkv))."""
    flags = bwd_verify(q, k, v, lse, grad, dq, dk, dv, reduce_stats(stats), rowmax, rec, step,
                       tuple(rows), scale, tol, dropout)  # fmt: skip
    return q.new_empty(0, dtype=_F32), flags


def _bwd_repair_ref(q, k, v, mask, out, lse, grad, dq, dk, dv, stats, rowmax, part, flags, sums,
                    rec, step, rows, causal, scale, tol, dropout=0.0, rng=None):  # fmt: skip
    bwd_repair(q, k, v, mask, out, lse, grad, dq, dk, dv, reduce_stats(stats), rowmax, flags,
               rec, tuple(rows), causal, scale, tol, dropout, rng)  # fmt: skip


def _nothing(*args) -> None:
    return None


REFERENCE = SdpaOps(
    kv_stats=define("sdpa_kv_stats", _kv_stats_ref, lambda k, v: k.new_empty(
        k.shape[0], k.shape[1], 1, 3 * k.shape[-1] + 2, dtype=_F32)),
    fwd_verify=define("sdpa_fwd_verify", _fwd_verify_ref,
                      lambda q, *_: q.new_empty(q.shape[0], q.shape[1], dtype=torch.int32)),
    fwd_repair=define("sdpa_fwd_repair", _fwd_repair_ref, _nothing),
    bwd_verify=define("sdpa_bwd_verify", _bwd_verify_ref, lambda q, k, *_: (
        q.new_empty(0, dtype=_F32), q.new_empty(k.shape[0], k.shape[1], dtype=torch.int32))),
    bwd_sums=define("sdpa_bwd_sums", lambda dk, dv: dk.new_empty(0, dtype=_F32),
                    lambda dk, dv: dk.new_empty(0, dtype=_F32)),
    bwd_repair=define("sdpa_bwd_repair", _bwd_repair_ref, _nothing),
)  # fmt: skip
"""The torch reference's family: what a CPU runs by default (the repairs read their flags on the
host, which costs nothing there)."""
