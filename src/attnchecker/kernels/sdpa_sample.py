"""Sampled recomputation on the SDPA route: what no cheap invariant sees in the backend's
black-box attention kernel (a lowered score, a small error in P or in the P V product) seen in
the rows that are sampled.

Per call and (batch, head), ``s`` query rows are drawn (:func:`sample_rows`) and recomputed in
fp32 from q, k, v and the mask: the scores row S_i, P_i, O_i and LSE_i, compared per element
with what the kernel delivered (O and LSE; S and P are not delivered: a fault in them shows in
O and, for S, in the LSE, which the kernel returns in fp32). Backward (:func:`bwd_sample`): dQ
rows of the same queries, dK / dV rows of ``s`` keys drawn likewise, recomputed in fp32 from
q, k, v, dO, the delivered O and the forward's LSE (what the backward kernel reads), compared
per element. The cost is ~s / L of attention's FLOPs, forward and backward; nothing of size
L x L is made (a (B, H, s, Lk) block of scores).

**The draw** is counter-based: a hash of (the clock's step, the module's salt, the (batch,
head) index) on the device (integer arithmetic below 2^47: exact on every device), so it reads
no generator (the model's dropout draws are bitwise those of the plain model), needs no host
value per step (no synchronisation, no tensor from host data, one graph under compile), and a
checkpointing replay of a layer (the clock does not tick) draws the same rows. Rows are
stratified: an offset r uniform in [0, L) and rows r + j floor(L / s) mod L (j < s), so a given
row is sampled with probability exactly s / L per call (:func:`coverage`).

**Bounds** (per element, derived for the sampled row i; eps: the delivered dtype's machine
epsilon, u = eps32; A_if = sum_j p_ij |v_jf|; r_ij = |scale| sum_f |q_if k_jf|; all times
``tolerance_scale``):

- the scores, kernel and reference, each accumulate d exact products in fp32: |dz_ij| <=
  (d + 2) u r_ij, so delta_i = 2 (d + 2) u max_j r_ij (both sides) bounds each score's error;
  exp / exp2 and the scale's rounding add a few u relative to |z| (8 u |LSE_i| and the + 8
  below); with half-precision operands a CPU's flash kernel adds 2^-13 (1 + |z|) per score
  (measured, :data:`_HALF_Z`: into delta_i and the LSE bound);
- LSE_i (fp32 in both): first order, dLSE = sum_j p_ij dz_ij, plus the normaliser's fp32 sum
  over Lk terms (Lk u) and the log: t_lse = 2 (sum_j p_ij r_ij (d + 2) u + (Lk + 8) u + 8 u
  |LSE_i|);
- O_if: the output rounded once (half an ulp: eps / 2 |O_if|), P rounded to the operands' dtype
  for the MMA (eps / 2 relative per p_ij: eps / 2 A_if; the normaliser is P's fp32 sum), fp32
  accumulation of P V and of the normaliser over Lk terms, in the kernel and the reference
  (2 (Lk + 4) u A_if), the scores' error (dO_if = sum_j p_ij (dz_ij - dLSE_i) v_jf: at most
  delta_i (A_if + |O_if|)), and a subnormal floor: t_o = eps / 2 (|O_if| + A_if) + 2 (Lk + 4) u
  A_if + delta_i (A_if + |O_if|) + floor. In bf16 the first term rules: an error above ~2^-8 of
  |O_if| + A_if is seen, a P error of 0.01 at a key with |v_jf| ~ 1 is ~10x the bound.

The backward's bounds are derived in :func:`_bwd_sample_flags`.

**Attention dropout**: the kernel's draw is not known for single rows (it follows each head's
place in the whole call; a rerun of the call for a few rows costs the call), so a dropout call
is not sampled (``summary()`` names it: :func:`coverage`).

A flag joins the route's own flags (:mod:`attnchecker.kernels.sdpa_check`'s (B, H) bits, or the
Triton family's per-block entries), so the existing repair recomputes the head (the Triton
repair: the flagged block of query rows) and writes the records: the scores check's row for an
LSE mismatch, the context check's row for an O mismatch (the reference family: this op writes
its own record into those rows; the Triton family: the repair kernel, from the merged entries).
The backward flags join (B, Hkv) bits of the backward's checks (dq, dk, dv rows).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnchecker.abft.tolerance import underflow_floor
from attnchecker.kernels import DEAD, SDPA_BLOCKS
from attnchecker.kernels.sdpa_backend import group_sum

__all__ = [
    "BWD_SAMPLE",
    "DEFAULT_SAMPLES",
    "FWD_SAMPLE",
    "bwd_sample",
    "coverage",
    "fwd_sample",
    "fwd_sample_flags",
    "sample_rows",
]

DEFAULT_SAMPLES = 2
"""Rows drawn per (batch, head) and call by default: s / L of attention's cost (0.05% at L =
4096), a persistent faulty row caught within ~L / s calls of its layer on average."""

_F32 = torch.float32
_U = torch.finfo(_F32).eps
# A CPU flash kernel's scores with half-precision operands carry more than fp32's rounding
# (measured: |dLSE| up to ~4e-5 (1 + |LSE|), the same in bf16 and fp16: its vectorised exp /
# reduced-precision intermediates); 2^-13 (1 + |z|) per score covers it with 3x to spare.
_HALF_Z = 2.0**-13
_CPU_BLOCK = 32
"""The CPU flash kernel's backward adds each block of (at least) 32 query rows into dK and dV in
their own dtype (half precision: measured, the kernel's dK equals that emulation bitwise where
an fp32 accumulation was two ulps away): one rounding of the partial sum per block, which
:func:`_bwd_sample_flags` adds to those bounds on a CPU. CUDA's flash kernels accumulate dK and
dV in fp32 registers over every query block."""
_M = 2147483647  # 2^31 - 1: the hash's modulus (products stay below 2^47 in int64)


def _mix(x: Tensor) -> Tensor:
    """Three rounds of a multiplicative hash mod 2^31 - 1 with xor-shifts, int64 in [0, 2^31)."""
    for a, c in ((48271, 12345), (69621, 40503), (16807, 2654435)):
        x = (x * a + c) % _M
        x = x ^ (x >> 11)
    return x


def sample_rows(step: Tensor, salt: int, B: int, H: int, L: int, s: int, stream: int = 0) -> Tensor:
    """(B, H, min(s, L)) int64 row indices drawn for one call at the clock's ``step`` (a device
    tensor) in the module ``salt``: stratified, r + j floor(L / s) mod L, r uniform per (batch,
    head); ``stream`` tells independent draws of one call apart (0: query rows, 1: key rows)."""
    n = min(s, L)
    bh = torch.arange(B * H, device=step.device, dtype=torch.int64).view(B, H, 1)
    base = step.reshape(-1)[:1].to(torch.int64) % _M  # (1,)
    x = (base * 1000003 + (salt % 65521) * 92821 + stream * 7919) % _M
    r = _mix((x + bh * 40499) % _M) % L  # (B, H, 1)
    j = torch.arange(n, device=step.device, dtype=torch.int64)
    return (r + j * (L // n)) % L  # (B, H, n)


def coverage(samples: int, L: int, *, dropout: float = 0.0, calls: int = 1) -> dict[str, object]:
    """The sampled check's coverage of a layer with sequence length ``L``: the probability that
    a given faulty query row (one (batch, head, row)) is sampled in one call (s / L), in a step
    of ``calls`` calls of the layer (micro-batches, each drawn afresh), and the expected steps
    (and the steps for 99%) to catch a fault that stays on the same row every step (a geometric
    wait). Dropout calls are not sampled."""
    if dropout > 0 or samples <= 0 or L <= 0:
        why = "off (samples=0)" if samples <= 0 else "off with attention dropout (its draw)"
        return {"rows": 0, "per_call": 0.0, "per_step": 0.0, "expected_steps": math.inf,
                "steps_99": math.inf, "note": why}  # fmt: skip
    p = min(samples, L) / L
    step = 1 - (1 - p) ** calls
    steps_99 = 1 if step >= 1 else math.ceil(math.log(0.01) / math.log1p(-step))
    return {"rows": min(samples, L), "per_call": p, "per_step": step,
            "expected_steps": 1 / step, "steps_99": steps_99,
            "note": "a given row is checked with probability per_call in each call"}  # fmt: skip


def _gather_rows(t: Tensor, idx: Tensor) -> Tensor:
    """t (B | 1, H | 1, L | 1, ...) at rows idx (B, H, n) -> (B, H, n, ...)."""
    B, H, n = idx.shape
    t = t.expand(B, H, *t.shape[2:])
    if t.shape[2] == 1:  # a broadcast row: every row
        return t.expand(B, H, n, *t.shape[3:])
    at = idx.view(B, H, n, *([1] * (t.dim() - 3))).expand(B, H, n, *t.shape[3:])
    return t.gather(2, at)


def _by_group(x: Tensor, Hkv: int) -> Tensor:
    """(B, H, n, ...) -> (B, Hkv, rep n, ...): query heads of a K/V head as one batch."""
    B, H, n = x.shape[:3]
    return x.reshape(B, Hkv, (H // Hkv) * n, *x.shape[3:])


def _by_head(x: Tensor, H: int) -> Tensor:
    """:func:`_by_group`'s inverse."""
    B, Hkv, m = x.shape[:3]
    return x.reshape(B, H, m // (H // Hkv), *x.shape[3:])


def _row_math(q, k, v, mask, causal, scale, idx):
    """fp32 recomputation of the rows idx (B, H, n): (p (B, H, n, Lk), o, lse, a = p |V|,
    r = |scale| |q_i| . |k_j| (B, H, n, Lk), live (B, H, n))."""
    H, Hkv, Lk = q.shape[1], k.shape[1], k.shape[2]
    with torch.autocast(q.device.type, enabled=False):
        qs = _by_group(_gather_rows(q, idx).float(), Hkv)  # (B, Hkv, rep n, d)
        kf, vf = k.float(), v.float()
        z = _by_head(qs @ kf.mT, H) * scale  # (B, H, n, Lk)
        r = _by_head(qs.abs() @ kf.abs().mT, H) * abs(scale)
        if mask is not None:
            z = z + _gather_rows(mask, idx).float()
        if causal:
            keys = torch.arange(Lk, device=q.device)
            z = z.masked_fill(keys > idx[..., None], -math.inf)
        m = z.amax(-1, keepdim=True)
        live = m[..., 0] > DEAD
        e = torch.exp(z - torch.where(live[..., None], m, 0.0))
        den = e.sum(-1, keepdim=True)
        p = torch.where(live[..., None], e / den.clamp(min=1e-38), 0.0)
        lse = torch.where(live, m[..., 0] + torch.log(den[..., 0].clamp(min=1e-38)), 0.0)
        o = _by_head(_by_group(p, Hkv) @ vf, H)  # (B, H, n, d)
        a = _by_head(_by_group(p, Hkv) @ vf.abs(), H)
    return p, o, lse, a, r, live


def fwd_sample_flags(q, k, v, mask, out, lse, causal, scale, tol, idx):
    """(lse_bad (B, H, n), o_bad (B, H, n, d), lse excess, o excess) of the sampled rows ``idx``
    against the delivered ``out`` and ``lse``: the bounds of the module docstring."""
    d, Lk = q.shape[-1], k.shape[2]
    p, o, lse_ref, a, r, live = _row_math(q, k, v, mask, causal, scale, idx)
    eps = torch.finfo(out.dtype).eps
    rl = torch.where(p > 0, r, 0.0)
    half = _HALF_Z if q.dtype in (torch.float16, torch.bfloat16) else 0.0
    delta = 2 * (d + 2) * _U * rl.amax(-1, keepdim=True)  # (B, H, n, 1)
    delta = delta + half * (1 + lse_ref.abs()[..., None] + rl.amax(-1, keepdim=True))
    lse_got = _gather_rows(lse.float(), idx)
    t_lse = tol * (2 * ((p * rl).sum(-1) * (d + 2) * _U + (Lk + 8) * _U + 8 * _U * lse_ref.abs())
                   + half * (1 + lse_ref.abs()))  # fmt: skip
    lse_ex = (lse_got - lse_ref).abs() - t_lse
    lse_bad = ~(lse_ex <= 0) & live
    o_got = _gather_rows(out, idx).float()
    tiny = torch.finfo(out.dtype).smallest_normal * eps  # (P underflowing for the MMA)
    t_o = tol * (eps / 2 * (o.abs() + a) + 2 * (Lk + 4) * _U * a + delta * (a + o.abs())
                 + tiny * _by_head(_by_group(torch.ones_like(p), k.shape[1])
                                   @ v.float().abs(), q.shape[1])
                 + underflow_floor(out.dtype, length=1, inner=Lk))  # fmt: skip
    o_ex = (o_got - o).abs() - t_o
    o_bad = ~(o_ex <= 0) & live[..., None]
    return lse_bad, o_bad, lse_ex, o_ex, lse_got, o_got


def _worst(values: Tensor, excess: Tensor) -> Tensor:
    from attnchecker.kernels.sdpa_check import _worst as worst

    return worst(values, excess)


def fwd_sample(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    flags: Tensor, log: Tensor, step: Tensor, rows: tuple[int, int], causal: bool, scale: float,
    tol: float, samples: int, salt: int, blocks: bool,
) -> None:  # fmt: skip
    """The forward's sampled check of one call: ``samples`` rows per (batch, head) recomputed
    and compared; the flags joined into ``flags`` (``blocks``: the Triton family's per-block
    entries, whose repair writes the records; else the (B, H) bits of the reference family,
    and the records added here to ``log`` rows ``rows``: scores, context)."""
    B, H, L, d = q.shape
    if samples <= 0 or L == 0:
        return
    idx = sample_rows(step, salt, B, H, L, samples)
    lse_bad, o_bad, lse_ex, o_ex, lse_got, o_got = fwd_sample_flags(
        q, k, v, mask, out, lse, causal, scale, tol, idx)  # fmt: skip
    o_rows = o_bad.any(-1)
    if blocks:
        _merge_blocks(flags, idx, lse_bad, o_bad, lse_ex, o_ex, lse_got, o_got, H, L, d)
        return
    from attnchecker.kernels.sdpa_check import _record

    # one record a check and call: where the invariants already recorded this call, not again
    lse_new = lse_bad & ~(flags & 1).any()
    o_new = o_bad & ~(flags & 2).any()
    if rows[0] >= 0:
        _record(log, rows[0], lse_new, torch.zeros(()), _worst(lse_got, lse_ex), step)
    if rows[1] >= 0:
        n_cols = o_new.flatten(0, 2).any(0).sum()
        _record(log, rows[1], o_new.any(-1), n_cols, _worst(o_got, o_ex), step)
    flags |= lse_bad.any(-1).int() | (o_rows.any(-1).int() << 1)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _merge_blocks(flags, idx, lse_bad, o_bad, lse_ex, o_ex, lse_got, o_got, H, L, d) -> None:
    """Join the sampled rows' flags into the Triton forward's per-block entries (bits, 2
    counts, 2 (excess, value) pairs as fp32 bits, a word per 16 features: see
    :func:`attnchecker.kernels.sdpa_kernels.entry_width`): a block whose entry the verify left
    clean takes the sampled rows' worst excess and value. Fixed-size scatters, no host read."""
    B = idx.shape[0]
    BM, BD = SDPA_BLOCKS[1], _block_d(d)
    nM, FW = -(-L // BM), 7 + BD // 16
    ent = flags[:-4].view(-1, FW)
    e = ((torch.arange(B * H, device=idx.device).view(B, H, 1) * nM) + idx // BM).reshape(-1)
    o_rows = o_bad.any(-1).reshape(-1)
    lb = lse_bad.reshape(-1)
    old = ent[:, 0].clone()
    bits = torch.zeros_like(old).scatter_reduce(0, e, lb.int(), "amax") | (
        torch.zeros_like(old).scatter_reduce(0, e, o_rows.int(), "amax") << 1)
    ent[:, 1].index_add_(0, e, lb.int())
    ent[:, 2].index_add_(0, e, o_rows.int())
    # the worst excess (NaN first) and its delivered value, where the verify had none
    o_key, o_at = torch.where(o_ex.isnan(), math.inf, o_ex).masked_fill(~o_bad, -math.inf).max(-1)
    o_val = o_got.gather(-1, o_at[..., None])[..., 0]
    for off, bad, key, val, bit in (
        (3, lb, torch.where(lse_ex.isnan(), math.inf, lse_ex).reshape(-1), lse_got.reshape(-1), 1),
        (5, o_rows, o_key.reshape(-1), o_val.reshape(-1), 2),
    ):  # fmt: skip
        key = key.masked_fill(~bad, -math.inf)
        best = torch.full(old.shape, -math.inf, device=key.device).scatter_reduce(
            0, e, key, "amax")  # fmt: skip
        pick = bad & (key == best[e])
        value = torch.full(old.shape, -math.inf, device=key.device).scatter_reduce(
            0, e, torch.where(pick, val, -math.inf), "amax")  # fmt: skip
        take = ((old & bit) == 0) & (best > -math.inf)
        ent[:, off] = torch.where(take, best.float().view(torch.int32), ent[:, off])
        ent[:, off + 1] = torch.where(take, value.float().view(torch.int32), ent[:, off + 1])
    cols = torch.zeros(ent.shape[0], BD, dtype=torch.int32, device=idx.device)
    feat = torch.nn.functional.pad(o_bad.reshape(-1, d).int(), (0, BD - d))
    cols = cols.scatter_reduce(0, e[:, None].expand(-1, BD), feat, "amax")
    words = (cols.view(-1, BD // 16, 16) << torch.arange(16, device=idx.device)).sum(-1)
    ent[:, 7:] |= words.int()
    ent[:, 0] = old | bits


# ------------------------------------------------------------------------------- the backward


def _bwd_sample_flags(q, k, v, mask, out, lse, grad, dq, dk, dv, rowmax, causal, scale, tol,
                      iq, ik):  # fmt: skip
    """(dq_bad (B, H, n, d), dk_bad (B, Hkv, n, d), dv_bad (B, Hkv, n, d), excesses) of the query
    rows ``iq`` (B, H, n) and the key rows ``ik`` (B, Hkv, n).

    The reference takes what the backward kernel reads: P_ij = exp(z_ij - LSE_i) with the
    forward's LSE, dP_ij = dO_i . v_j, D_i = dO_i . O_i from the delivered O, dS = P o (dP - D),
    dQ_i = scale sum_j dS_ij k_j, dV_j = sum_i P_ij dO_i, dK_j = scale sum_i dS_ij q_i (dK / dV
    summed over the K/V head's query heads). Per element, in the kernel and the reference (so
    twice each): p_ij relative error e_ij = (d + 2) u r_ij + 4 u (|z_ij| + |LSE_i|) (the score's
    fp32 sum, exp, the LSE's subtraction); dP_ij and D_i fp32 sums over d: (d + 2) u |dO_i| .
    |v_j| and (d + 2) u |dO_i| . |O_i|; so |err dS_ij| <= 2 p_ij (e_ij |dP_ij - D_i| + (d + 2) u
    (|dO_i| . |v_j| + |dO_i| . |O_i|)) + eps / 2 |dS_ij| (dS rounded to the operands' dtype for
    the MMA). dQ_if: scale sum_j (err dS_ij) |k_jf| + 2 (Lk + 4) u scale sum_j |dS_ij| |k_jf|
    (fp32 accumulation) + eps / 2 |dQ_if| (the output's half ulp) + a subnormal floor; dK
    likewise over the queries (rep L terms); each dS_ij and p_ij rounded for an MMA also loses
    up to a subnormal spacing where it underflows (fp16), added per term; dV_jf: (eps / 2 +
    2 e_ij + 2 (rep L + 4) u) sum_i p_ij |dO_if| + eps / 2 |dV_jf| + floor. Query rows that
    attend no key (``rowmax`` DEAD: the kernels' P there is theirs: 0, or 1 where a finite mask
    minimum absorbs the scores) add their worst case to dK and dV (P <= 1) and are not checked
    in dQ. On a CPU, half-precision dK and dV are summed a block of query rows at a time in
    their dtype (:data:`_CPU_BLOCK`): ceil(rep L / 32) eps / 2 of their terms' magnitudes more."""
    B, H, L, d = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    eps = torch.finfo(dq.dtype).eps
    c = (d + 2) * _U
    dead_all = (rowmax.to(q.device) <= DEAD).expand(B, H, L)
    with torch.autocast(q.device.type, enabled=False):
        qf, kf, vf, g, o = (t.float() for t in (q, k, v, grad, out))
        lse_f = lse.float()
        big = torch.where(dead_all, 0.0, lse_f).nan_to_num(0.0, 0.0, 0.0)
        # --- dQ rows of the sampled queries
        qs, gs, os_ = (_by_group(_gather_rows(t, iq), Hkv) for t in (qf, g, o))  # (B,Hkv,rn,d)
        ls = _gather_rows(big, iq)[..., None]  # (B, H, n, 1)
        dead = _gather_rows(dead_all, iq)
        z = _by_head(qs @ kf.mT, H) * scale  # (B, H, n, Lk)
        r = _by_head(qs.abs() @ kf.abs().mT, H) * abs(scale)
        if mask is not None:
            z = z + _gather_rows(mask, iq).float()
        if causal:
            z = z.masked_fill(torch.arange(Lk, device=q.device) > iq[..., None], -math.inf)
        p = torch.where(dead[..., None], 0.0, torch.exp(z - ls))
        dp = _by_head(gs @ vf.mT, H)  # (B, H, n, Lk)
        dpa = _by_head(gs.abs() @ vf.abs().mT, H)
        dd = _by_head((gs * os_).sum(-1, keepdim=True), H)  # (B, H, n, 1)
        dda = _by_head((gs.abs() * os_.abs()).sum(-1, keepdim=True), H)
        ds = p * (dp - dd)
        half = _HALF_Z if q.dtype in (torch.float16, torch.bfloat16) else 0.0
        e = c * r + (4 * _U + half) * (z.abs().nan_to_num(0.0, 0.0, 0.0) + ls.abs()) + half
        # (+ tiny: each dS_ij rounded for the MMA loses up to a subnormal spacing where it
        # underflows, fp16 without a loss scale)
        tiny = torch.finfo(dq.dtype).smallest_normal * eps
        err = 2 * p * (e * (dp - dd).abs() + c * (dpa + dda)) + (
            eps / 2 + 2 * (Lk + 4) * _U) * ds.abs() + tiny  # fmt: skip
        dq_ref = _by_head(_by_group(ds, Hkv) @ kf, H) * scale
        t_q = tol * (eps / 2 * dq_ref.abs()
                     + abs(scale) * _by_head(_by_group(err, Hkv) @ kf.abs(), H)
                     + underflow_floor(dq.dtype, length=1, inner=Lk))  # fmt: skip
        q_ex = (_gather_rows(dq, iq).float() - dq_ref).abs() - t_q
        q_bad = ~(q_ex <= 0) & ~dead[..., None]
        # --- dK / dV rows of the sampled keys (B, Hkv, n)
        ks, vs = _gather_rows(kf, ik), _gather_rows(vf, ik)  # (B, Hkv, n, d)
        qg, gg, og = (_by_group(t, Hkv) for t in (qf, g, o))  # (B, Hkv, rep L, d)
        dead_g = _by_group(dead_all, Hkv)[..., None]  # (B, Hkv, rep L, 1)
        lg = _by_group(big, Hkv)[..., None]
        zc = (qg @ ks.mT) * scale  # (B, Hkv, rep L, n)
        rc = (qg.abs() @ ks.abs().mT) * abs(scale)
        if mask is not None:
            ikh = ik.repeat_interleave(H // Hkv, 1)  # (B, H, n): each query head's keys
            m = mask.expand(B, H, L, Lk).gather(3, ikh[:, :, None, :].expand(B, H, L, -1))
            zc = zc + _by_group(m, Hkv).float()
        if causal:
            rows = torch.arange(L, device=q.device).repeat(H // Hkv)[:, None]  # (rep L, 1)
            zc = zc.masked_fill(ik[:, :, None, :] > rows, -math.inf)
        pc = torch.where(dead_g, 0.0, torch.exp(zc - lg))
        dpc = gg @ vs.mT  # (B, Hkv, rep L, n)
        dpca = gg.abs() @ vs.abs().mT
        ddg = (gg * og).sum(-1, keepdim=True)
        ddga = (gg.abs() * og.abs()).sum(-1, keepdim=True)
        dsc = pc * (dpc - ddg)
        ec = c * rc + (4 * _U + half) * (zc.abs().nan_to_num(0.0, 0.0, 0.0) + lg.abs()) + half
        n_q = (H // Hkv) * L
        errc = 2 * pc * (ec * (dpc - ddg).abs() + c * (dpca + ddga)) + (
            eps / 2 + 2 * (n_q + 4) * _U) * dsc.abs() + tiny  # fmt: skip
        deadf = dead_g.float()
        # a CPU kernel's half-precision partial sums of dK and dV, one rounding a query block
        # (_CPU_BLOCK), each at most eps / 2 of the sum of the terms' magnitudes
        blocked = dk.device.type == "cpu" and dk.dtype in (torch.float16, torch.bfloat16)
        acc = math.ceil(n_q / _CPU_BLOCK) * eps / 2 if blocked else 0.0
        dk_ref = (dsc.mT @ qg) * scale  # (B, Hkv, n, d)
        t_k = tol * (eps / 2 * dk_ref.abs() + abs(scale) * (errc.mT @ qg.abs())
                     + abs(scale) * ((dpca + ddga) * deadf).mT @ qg.abs()
                     + underflow_floor(dk.dtype, length=1, inner=n_q))  # fmt: skip
        dv_ref = pc.mT @ gg
        w = (eps / 2 + 2 * (n_q + 4) * _U + acc) * pc + 4 * pc * ec + tiny
        t_v = tol * (eps / 2 * dv_ref.abs() + (w + deadf).mT @ gg.abs()
                     + underflow_floor(dv.dtype, length=1, inner=n_q))  # fmt: skip
        if blocked:
            t_k = t_k + tol * acc * abs(scale) * (dsc.abs().mT @ qg.abs())
        k_ex = (_gather_rows(dk, ik).float() - dk_ref).abs() - t_k
        v_ex = (_gather_rows(dv, ik).float() - dv_ref).abs() - t_v
    return q_bad, ~(k_ex <= 0), ~(v_ex <= 0), q_ex, k_ex, v_ex


def bwd_sample(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, out: Tensor, lse: Tensor,
    grad: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, rowmax: Tensor, flags: Tensor,
    rec: Tensor, step: Tensor, rows: tuple[int, int, int], causal: bool, scale: float,
    tol: float, samples: int, salt: int,
) -> None:  # fmt: skip
    """The backward's sampled check of one call: dQ of the forward's sampled query rows, dK and
    dV of ``samples`` key rows per (batch, K/V head), recomputed and compared; records added
    to ``rec`` rows ``rows`` (dq, dk, dv; -1: not recorded) and the flags joined into
    ``flags``, (B, Hkv) bits 1, 2, 4 (dq, dk, dv), which the backward's repair reads."""
    B, H, L = q.shape[:3]
    Hkv, Lk = k.shape[1], k.shape[2]
    if samples <= 0 or L == 0 or Lk == 0:
        return
    from attnchecker.kernels.sdpa_check import _record

    iq = sample_rows(step, salt, B, H, L, samples)
    ik = sample_rows(step, salt, B, Hkv, Lk, samples, stream=1)
    q_bad, k_bad, v_bad, q_ex, k_ex, v_ex = _bwd_sample_flags(
        q, k, v, mask, out, lse, grad, dq, dk, dv, rowmax, causal, scale, tol, iq, ik)  # fmt: skip
    for row, bad, ex, t, idx in ((rows[0], q_bad, q_ex, dq, iq), (rows[1], k_bad, k_ex, dk, ik),
                                 (rows[2], v_bad, v_ex, dv, ik)):  # fmt: skip
        if row >= 0:
            _record(rec, row, bad.any(-1), bad.flatten(0, 2).any(0).sum(),
                    _worst(_gather_rows(t, idx), ex), step)  # fmt: skip
    q_group = group_sum(q_bad.any((-1, -2)).int(), Hkv) > 0
    flags |= q_group.int() | (k_bad.any((-1, -2)).int() << 1) | (v_bad.any((-1, -2)).int() << 2)


# ------------------------------------------------------------------------ the registered ops
# One op a pass (what a CPU counts as one launch; opaque to torch.compile), the torch reference
# above as its kernel on every device (s rows: a few small GEMMs).


def _fwd_sample_op(q, k, v, mask, out, lse, flags, log, step, rows, causal, scale, tol, samples,
                   salt, blocks):  # fmt: skip
    fwd_sample(q, k, v, mask, out, lse, flags, log, step, tuple(rows), causal, scale, tol,
               samples, salt, blocks)  # fmt: skip


def _bwd_sample_op(q, k, v, mask, out, lse, grad, dq, dk, dv, rowmax, flags, rec, step, rows,
                   causal, scale, tol, samples, salt):  # fmt: skip
    bwd_sample(q, k, v, mask, out, lse, grad, dq, dk, dv, rowmax, flags, rec, step, tuple(rows),
               causal, scale, tol, samples, salt)  # fmt: skip


FWD_SAMPLE = torch.library.custom_op(
    "attnchecker::sdpa_fwd_sample", _fwd_sample_op, mutates_args=("flags", "log"),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, "
    "Tensor(a!) flags, Tensor(b!) log, Tensor step, int[] rows, bool causal, float scale, "
    "float tol, int samples, int salt, bool blocks) -> ()",
)  # fmt: skip
FWD_SAMPLE.register_fake(lambda *args: None)
BWD_SAMPLE = torch.library.custom_op(
    "attnchecker::sdpa_bwd_sample", _bwd_sample_op, mutates_args=("flags", "rec"),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor out, Tensor lse, Tensor grad, "
    "Tensor dq, Tensor dk, Tensor dv, Tensor rowmax, Tensor(a!) flags, Tensor(b!) rec, "
    "Tensor step, int[] rows, bool causal, float scale, float tol, int samples, int salt) -> ()",
)  # fmt: skip
BWD_SAMPLE.register_fake(lambda *args: None)
