"""The heads' checks of protected attention: the scores, the probabilities and the context.

Heads, t (B, H, L, M) of the scores, probabilities and context: every query row is checked
(references below); one repair per layer (:func:`heads_repair_`) recomputes the ``max_heads``
(batch, head) matrices with the most flagged rows over all three checks, which repairs any
pattern inside them:

- scores s = alpha q k^T: sum_j s_ij = alpha q_i . sum_j k_j; magnitude bound
  M_i = |alpha| ||q_i|| sum_j ||k_j||.
- probabilities: every row sums to 1; each element carries a few roundings relative to itself
  (exp, normalisation: 8 u_fp32) and one to p's dtype, the fp32 sum adds Lk u_fp32.
- context c = p v: sum_f c_if = sum_j p_ij (sum_f v_jf); p >= 0 is its own magnitude, so one
  thin GEMM p [v-bar, |v|-bar] gives the reference and its exact magnitude M_i (and, with no
  dropout between them, p [1] the probabilities' row sums in the same GEMM).

The scores' and the context's tolerance is the GEMM checks' rounding-tight bound (issue 55,
:func:`~attnchecker.abft.tolerance.gemm_terms`): floor + f_abs min(A_i, CAP M_i) + f_mag M_i,
A_i the delivered row's L1 norm (the outputs' own rounding, charged to what they are, not to
the magnitude: ~10x tighter at d 64), f_mag the probabilistic accumulation term; an operand the
GEMM rounded first (autocast's bf16 copy of fp32 probabilities) adds its dtype's roundoff to
f_mag, and a scaling inside the GEMM (GPT-2's folded alpha) one more rounding to f_abs.

Each check returns (residual, excess) per query row; :func:`heads_repair_` writes the records
(:func:`~attnchecker.attention.checks.record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnchecker.abft.cast import round_as
from attnchecker.abft.tolerance import norm_bound, tight_excess, unit_roundoff
from attnchecker.attention.checks import no_autocast, record

__all__ = ["context_residual", "heads_repair_", "probs_residual", "scores_residual"]

_U32 = unit_roundoff(torch.float32)

Recompute = Callable[[Tensor, Tensor], Sequence[Tensor]]  # (b_idx, h_idx) (Kh,) -> (Kh, L, M_i)


def scores_residual(
    s: Tensor,
    q: Tensor,
    k: Tensor,
    *,
    alpha: float = 1.0,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """(residual, excess), both (B, H, L), of the rows of s = alpha q k^T (B, H, L, Lk); excess
    is > 0 (or NaN) on flagged rows; q (B, H, L, d), k (B, H, Lk, d).
    """
    d, Lk = q.shape[-1], k.shape[-2]
    with no_autocast(s.device):
        (q, k), rounded = _as_multiplied(s, q, k)
        ref = (q * k.sum(-2, keepdim=True, dtype=torch.float32)).sum(-1)  # (B, H, L)
        qn = norm_bound(q, -1)  # (B, H, L)
        kn = norm_bound(k, -1).sum(-1, keepdim=True)  # (B, H, 1)
        res = s.sum(-1, dtype=torch.float32) - (ref if alpha == 1.0 else ref * alpha)
        mag = qn * kn  # >= sum_j sum_f |q_if k_jf| (Cauchy-Schwarz)
        if alpha != 1.0:
            mag = mag * abs(alpha)
        return res, tight_excess(res, s, mag, inner=d, length=Lk, scale=scale, rounded=rounded,
                                 scaled=alpha != 1.0)  # fmt: skip


def _as_multiplied(out: Tensor, *ops: Tensor) -> tuple[list[Tensor], int]:
    """The operands of the GEMM that gave ``out`` as it multiplied them, and how many others
    differ from out's dtype (their rounding stays in the bound): an operand wider than a half
    precision out (fp32 q and k after a rotary embedding, fp32 probabilities, under autocast)
    was rounded to it, so the reference takes it so rounded (:func:`round_as`: fp32 values,
    a round trip a user's ``torch.compile`` keeps), not charging that rounding to the
    magnitude (~2% of a bf16 row where V's features cancel: measured in a llama layer)."""
    half = out.dtype in (torch.float16, torch.bfloat16)
    wide = [half and t.element_size() > out.element_size() for t in ops]
    got = [round_as(t, out.dtype) if w else t for t, w in zip(ops, wide, strict=True)]
    return got, sum(t.dtype != out.dtype and not w for t, w in zip(ops, wide, strict=True))


def _probs_tol(p: Tensor, scale: float) -> float:
    """Each element carries a few roundings relative to itself (exp, normalisation: 8 u_fp32)
    and one to p's dtype; an fp32 sum of Lk of them adds Lk u_fp32."""
    return 2 * scale * (unit_roundoff(p.dtype) + (8 + p.shape[-1]) * _U32)


def probs_residual(p: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """(residual, excess) (B, H, L) of the rows of the probabilities p (B, H, L, Lk): sum to 1."""
    res = p.sum(-1, dtype=torch.float32) - 1
    return res, res.abs() - _probs_tol(p, scale)


def context_residual(
    c: Tensor,
    p: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    v_sums: tuple[Tensor, Tensor] | None = None,
    with_probs: bool = False,
) -> tuple[Tensor, ...]:
    """(residual, excess) (B, H, L) of the rows of c = p v (B, H, L, d), from p (B, H, L, Lk) and
    v (B, H, Lk, d). ``v_sums`` = (sum_f v_jf as the V projection check derived it from X and W,
    how far the delivered sums may be from it), both (B, H, Lk); otherwise the sums come from v.
    The bound sum_f |v_jf| always comes from v (p >= 0 is its own magnitude).

    ``with_probs``: p is the softmax output itself (no dropout between): the same thin GEMM
    also sums p's rows, and the probabilities' (residual, excess) follow the context's.

    The reference takes p as the GEMM multiplied it (:func:`_as_multiplied`); where p was
    rounded so, p's row sums come from p itself in one more pass."""
    Lk, d = v.shape[-2], v.shape[-1]
    with no_autocast(c.device):
        f32 = torch.float32
        (pg,), rounded = _as_multiplied(c, p)  # (v's sums come from v as delivered)
        rounded += v.dtype != c.dtype
        wide = pg is not p  # p rounded for the reference: its row sums in their own pass
        cols = [v.sum(-1, dtype=f32) if v_sums is None else v_sums[0], v.abs().sum(-1, dtype=f32)]
        if v_sums is not None:
            cols.append(v_sums[1])
        if with_probs and not wide:
            cols.append(torch.ones_like(cols[1]))
        both = pg.to(f32) @ torch.stack(cols, -1)  # (B, H, L, 2..4): ref, bound, [error], [sum p]
        res = c.sum(-1, dtype=f32) - both[..., 0]
        excess = tight_excess(res, c, both[..., 1], inner=Lk, length=d, scale=scale,
                              rounded=rounded)
        out: tuple[Tensor, ...] = (res, excess if v_sums is None else excess - both[..., 2])
        if with_probs:
            res_p = (p.sum(-1, dtype=f32) if wide else both[..., -1]) - 1
            out += (res_p, res_p.abs() - _probs_tol(p, scale))
        return out


def _same(new: Tensor, old: Tensor) -> Tensor:
    """(K,) whether each of K matrices (K, ...) came out of the recomputation as delivered: where
    the delivered one holds INF / NaN, the same non-finite values at the same places (its finite
    entries may round differently: a GEMM of another shape sums in another order, measured on an
    AVX-512 CPU); otherwise bitwise the same."""
    K, new = old.shape[0], new.to(old.dtype)
    eq = (new == old) | (new.isnan() & old.isnan())
    finite = old.isfinite()
    extreme = ~finite.view(K, -1).all(1)
    same_extremes = ((new.isfinite() == finite) & (eq | finite)).view(K, -1).all(1)
    return torch.where(extreme, same_extremes, eq.view(K, -1).all(1))


@torch.no_grad()
def heads_repair_(
    targets: Sequence[Tensor],
    checks: Sequence[tuple[Tensor, Tensor]],
    recompute: Recompute,
    *,
    max_heads: int,
    probe: Tensor | None = None,
) -> Tensor:
    """Recompute the ``max_heads`` (batch, head) matrices with the most flagged rows over all
    ``checks`` in every tensor of ``targets`` (B, H, L, M_i), in place: one repair for the
    checks of a chain (scores -> probs -> context recomputed together), given in chain order.
    ``probe``: a tensor of the chain that is not written (the scores), which ``recompute``
    returns last, after the targets; a matrix is *reproduced* when it and the last target come
    out of the recomputation exactly as delivered.

    Each check is (residual, excess), both (B, H, L), excess > 0 (or NaN) on flagged rows.
    Returns (len(checks), 5) records: flagged rows (twice: row checks alone cannot tell an
    element from a row, so a pattern is one row or several), the residual of the check's worst
    row, whether more matrices were flagged than repaired or a recomputed one is not finite
    again (lost), and the latter alone (reproduced).
    """
    C = len(checks)
    B, H, _ = checks[0][1].shape
    Kh = min(max_heads, B * H)
    excess = torch.stack([e for _, e in checks])  # (C, B, H, L)
    bad = ~(excess <= 0)
    # a row is counted by the first check of the chain that flags it (a NaN in the scores
    # also fails the probabilities' and the context's sums: one fault, one report)
    first = bad & (bad.cumsum(0) == 1) if C > 1 else bad
    rows = first.sum((1, 2, 3), dtype=torch.float32)  # (C,)
    top, idx = bad.sum((0, 3)).view(B * H).topk(min(Kh + 1, B * H))  # flagged rows per matrix
    flagged = top > 0
    lost = flagged[Kh] if Kh < B * H else flagged[0] & False
    take, idx = flagged[:Kh, None, None], idx[:Kh]
    news = list(recompute(idx // H, idx % H))
    probe_new = news.pop() if probe is not None else None
    for t, new in zip(targets, news, strict=True):
        t3 = t.data.view(B * H, *t.shape[-2:])
        old, new = t3.index_select(0, idx), new.to(t.dtype)
        t3.index_copy_(0, idx, torch.where(take, new, old))
    # a flagged matrix whose chain's end (the context; a gradient) and probe (the scores) are
    # recomputed exactly as delivered, NaN for NaN: its operands imply it (an overflow of the
    # dtype, a fault upstream), not these GEMMs
    same = _same(new, old)
    if probe is not None:
        same &= _same(probe_new, probe.data.view(B * H, *probe.shape[-2:]).index_select(0, idx))
    again = (same & take.view(-1)).any()
    # each check's worst row (NaN ranks first; a tensor, never a Python int)
    worst = excess.view(C, -1).argmax(1, keepdim=True)  # (C, 1)
    value = torch.stack([r for r, _ in checks]).view(C, -1).gather(1, worst).view(C)
    return record(rows, rows, value, (lost | again).expand(C), again.expand(C))
