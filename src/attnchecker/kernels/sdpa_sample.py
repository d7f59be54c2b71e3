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
  exp / exp2 and the scale's rounding add a few u relative to |z| (8 u |LSE_i| and the + 8 below);
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
    "DEFAULT_SAMPLES",
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
        why = "off (samples=0)" if samples <= 0 else "off with attention dropout (the kernel's draw)"
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
    t = t.expand(B, H, *t.shape[2:]) if t.dim() > 2 else t.expand(B, H, t.shape[-1])
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
    delta = 2 * (d + 2) * _U * rl.amax(-1, keepdim=True)  # (B, H, n, 1)
    lse_got = _gather_rows(lse.float(), idx)
    t_lse = tol * 2 * ((p * rl).sum(-1) * (d + 2) * _U + (Lk + 8) * _U + 8 * _U * lse_ref.abs())
    lse_ex = (lse_got - lse_ref).abs() - t_lse
    lse_bad = ~(lse_ex <= 0) & live
    o_got = _gather_rows(out, idx).float()
    t_o = tol * (eps / 2 * (o.abs() + a) + 2 * (Lk + 4) * _U * a + delta * (a + o.abs())
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

    if rows[0] >= 0:
        _record(log, rows[0], lse_bad, torch.zeros(()), _worst(lse_got, lse_ex), step)
    if rows[1] >= 0:
        n_cols = o_bad.flatten(0, 2).any(0).sum()
        _record(log, rows[1], o_rows, n_cols, _worst(o_got, o_ex), step)
    flags |= lse_bad.any(-1).int() | (o_rows.any(-1).int() << 1)


def _block_d(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _merge_blocks(flags, idx, lse_bad, o_bad, lse_ex, o_ex, lse_got, o_got, H, L, d) -> None:
    """Join the sampled rows' flags into the Triton forward's per-block entries (bits, 2
    counts, 2 (excess, value) pairs as fp32 bits, a word per 16 features: see
    :func:`attnchecker.kernels.sdpa_kernels.entry_width`): a block whose entry the verify left
    clean takes the sampled rows' worst excess and value. Fixed-size scatters, no host read."""
    B, _, n = idx.shape
    BM, BD = SDPA_BLOCKS[1], _block_d(d)
    nM, FW = -(-L // BM), 7 + BD // 16
    ent = flags[:-4].view(-1, FW)
    e = ((torch.arange(B * H, device=idx.device).view(B, H, 1) * nM) + idx // BM).reshape(-1)
    o_rows = o_bad.any(-1).reshape(-1)
    lb = lse_bad.reshape(-1)
    old = ent[:, 0].clone()
    bits = torch.zeros_like(old).scatter_reduce(0, e, lb.int() | (o_rows.int() << 1), "amax")
    bits = bits | torch.zeros_like(old).scatter_reduce(0, e, lb.int(), "amax")
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
