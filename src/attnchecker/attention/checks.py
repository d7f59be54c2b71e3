"""The checks protected attention runs: detect with checksums, repair by recomputing from operands.

Every check compares, per checked vector, a *reference* sum derived from the operands with the
sum *recomputed* from the delivered output, and flags the vector when they differ by more than
a rounding-error bound (NaN compares False, so NaN is flagged too). What is flagged is repaired
by recomputing a fixed number of units from the operands with the op that produced them: fixed
sizes, so no step needs a host synchronisation, and a repaired value is what a fault-free run
computes (up to the rounding of a smaller GEMM). Repairs write through ``.data``: the repaired
tensor may already be saved for backward (softmax saves its output), and the saved values must
become the repaired ones without tripping autograd's version check.

Projections, y = x W^T + b (T = B * L tokens, K inputs, N outputs in G head groups of n), one
call for all the projections of one input (Q, K and V share x):

- rows: for every token t and group g, sum_{o in g} y_to against x_t . (sum_{o in g} W_o) +
  sum_{o in g} b_o, one thin GEMM (T, K) x (K, sum G) for all of them. Bound on the rounding
  error, by Cauchy-Schwarz on the augmented vectors [x_t, 1] and [W_o, b_o]:
  sum_{o in g} (sum_k |x_tk W_ok| + |b_o|) <= sqrt(n) (||x_t|| + 1) ||[W_g | b_g]||_F, times the
  factor of :func:`~attnchecker.abft.tolerance.magnitude_factor`. Up to ``max_rows`` worst rows
  are recomputed (one element, a token row, 2D blocks spanning up to ``max_rows`` tokens).
- columns: a range check that needs no reference, |sum_t y_to| <= sum_t (||x_t|| + 1) ||W~||_F,
  one scalar bound per projection, so the largest column sum is the worst column: it is
  recomputed over all tokens (the flattened GEMM's column) when it breaks the bound. This locates
  and repairs extreme whole-column errors (INF, NaN, near-INF, large), which flag every row.

Heads, t (B, H, L, M) of the scores, probabilities and context: every query row is checked
(references below) and the ``max_heads`` worst (batch, head) matrices are recomputed, which
repairs any pattern inside them:

- scores s = alpha q k^T: sum_j s_ij = alpha q_i . sum_j k_j; bound |alpha| ||q_i|| sum_j ||k_j||.
- probabilities: every row sums to 1; each element carries a few roundings relative to itself
  (exp, normalisation: 8 u_fp32) and one to p's dtype, the fp32 sum adds Lk u_fp32.
- context c = p v: sum_f c_if = sum_j p_ij (sum_f v_jf); p >= 0 is its own magnitude, so one
  thin GEMM p [v-bar, |v|-bar] gives the reference and its bound.

Each check returns float32 records [flagged rows, moved columns, value, lost], one per site;
the state turns a layer's records into :data:`~attnchecker.attention.state.RECORD_FIELDS` and
adds them to its device log in one go.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from attnchecker.abft.tolerance import magnitude_factor, underflow_floor, unit_roundoff

__all__ = [
    "Projection",
    "WeightSums",
    "context_residual",
    "heads_repair_",
    "probs_residual",
    "projection_check_",
    "row_factor",
    "row_floor",
    "scores_residual",
    "weight_sums",
]

_U32 = unit_roundoff(torch.float32)


def _no_autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, enabled=False)


def _factor(out: Tensor, *operands: Tensor, inner: int, length: int) -> float:
    """Tolerance factor; operands wider than the output (autocast) were rounded to its dtype
    before the GEMM, which adds one rounding of each operand to every product."""
    rounded = sum(op.dtype != out.dtype for op in operands)
    return magnitude_factor(
        out.dtype, out.device, inner=inner, length=length
    ) + rounded * unit_roundoff(out.dtype)


def _record(rows: Tensor, cols: Tensor, value: Tensor, lost: Tensor) -> Tensor:
    """(n, 4) float32 records [rows, cols, value, lost] from float32 n-vectors or 0-dim tensors
    (``lost`` may be bool)."""
    return torch.stack([rows, cols, value, lost.to(torch.float32)], -1).view(-1, 4)


# --------------------------------------------------------------------------------- projections


@dataclass(frozen=True)
class Projection:
    """A projection y = x W^T + b as the check sees it: its parameters, its weight layout and how
    its N outputs split into sites (P parts, e.g. Q|K|V of a fused projection) and head groups."""

    weight: Tensor  # (N, K); (K, N) for GPT-2's Conv1D
    bias: Tensor | None  # (N,)
    conv1d: bool
    sites: tuple[str, ...]
    groups: int  # head groups over the N outputs, a multiple of len(sites)

    def rows(self, x: Tensor) -> Tensor:
        """Output rows for input rows x (R, K), with the module's op (same dtype under autocast)."""
        if self.conv1d:
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def column(self, x: Tensor, f: Tensor) -> Tensor:
        """Output feature ``f`` (1,) for every input row of x (T, K): (T, 1)."""
        w = (
            self.weight.index_select(0, f).t()
            if not self.conv1d
            else self.weight.index_select(1, f)
        )
        if self.bias is None:
            return x @ w
        return torch.addmm(self.bias.index_select(0, f), x, w)


class WeightSums(NamedTuple):
    """Weight-derived operands of a projection's row check, per head group (fp32).

    Recomputed at every call, never cached: fused optimizers (``torch._fused_adamw_``, the
    Trainer's default) update parameters without bumping their version counter, so no cheap key
    says when a cache is stale (a stale sum is a false alarm on every row)."""

    sums: Tensor  # (K, G): W summed over each group's outputs
    bias: Tensor | None  # (G,): b summed over each group
    norms: Tensor  # (G,): ||[W_g | b_g]||_F, plus an absolute floor (see projection_check_)
    total: Tensor  # (): ||[W | b]||_F of the whole projection


def weight_sums(proj: Projection, floor: float) -> WeightSums:
    """The sums of ``proj``'s parameters, with ``floor`` added to the group norms."""
    w, b, G = proj.weight, proj.bias, proj.groups
    with torch.no_grad(), _no_autocast(w.device):
        f32 = torch.float32
        if proj.conv1d:  # (K, N)
            wv = w.view(w.shape[0], G, -1)
            sums, norms = wv.sum(-1, dtype=f32), torch.linalg.vector_norm(wv, dim=(0, 2), dtype=f32)
        else:  # (N, K)
            wv = w.view(G, -1, w.shape[-1])
            sums = wv.sum(1, dtype=f32).t()
            norms = torch.linalg.vector_norm(wv, dim=(1, 2), dtype=f32)
        bias = None
        if b is not None:
            bv = b.view(G, -1)
            bias = bv.sum(-1, dtype=f32)
            norms = torch.hypot(norms, torch.linalg.vector_norm(bv, dim=-1, dtype=f32))
        total = torch.linalg.vector_norm(norms)
        return WeightSums(sums, bias, norms + floor, total)


def row_factor(x: Tensor, items: list[tuple[Projection, Tensor]], scale: float) -> float:
    """The factor c with |reference - row sum| <= c (||x_t|| + 1) ||[W_g | b_g]||_F for every
    projection y = x W^T + b of ``items`` (the largest over them): sqrt(n) by Cauchy-Schwarz over
    the n outputs of a group, times the rounding factor of a (K + 1)-term inner product (the bias
    is the extra term), plus two roundings to x's dtype (the reference is computed in it)."""
    K = x.shape[-1]
    return scale * max(
        _factor(y, x, p.weight, inner=K + 1, length=y.shape[-1] // p.groups)
        * math.sqrt(y.shape[-1] // p.groups)
        + 2 * unit_roundoff(x.dtype)
        for p, y in items
    )


def row_floor(items: list[tuple[Projection, Tensor]]) -> float:
    """Absolute slack of a row sum: elements that underflow lose a subnormal spacing each."""
    return max(underflow_floor(y.dtype, length=y.shape[-1] // p.groups) for p, y in items)


_SEGMENTS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _segments(sizes: tuple[int, ...], device: torch.device) -> Tensor:
    """(sum(sizes), len(sizes)) float32 indicator of consecutive segments (a cached constant in
    eager; under torch.compile a constant of the graph)."""
    key = (sizes, device)
    if key in _SEGMENTS:
        return _SEGMENTS[key]
    ind = torch.zeros(sum(sizes), len(sizes), device=device)
    start = 0
    for i, n in enumerate(sizes):
        ind[start : start + n, i] = 1.0
        start += n
    if not torch.compiler.is_compiling():
        _SEGMENTS[key] = ind
    return ind


@torch.no_grad()
def projection_check_(
    x: Tensor,
    items: list[tuple[Projection, Tensor, WeightSums]],
    *,
    max_rows: int,
    factor: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Check and repair in place the outputs y (B, L, N_i) = x (B, L, K) W_i^T + b_i of the
    projections of one input; see the module docstring.

    ``factor`` (:func:`row_factor`) times the bound is the tolerance of a row sum; the weight
    sums carry the absolute floor. Returns the records (one per site, in order), the row
    references (T, sum G) and the magnitude bounds (T, sum G) >= (||x_t|| + 1) ||[W_g | b_g]||_F:
    what the attention core may take from here (``mode="passing"``).
    """
    B, L, K = x.shape
    T, R = B * L, min(max_rows, B * L)
    projs = [p for p, _, _ in items]
    ys = [y.data.view(T, y.shape[-1]) for _, y, _ in items]  # (T, N_i), written in place
    ws = [w for _, _, w in items]
    x2 = x.reshape(T, K)
    f32 = torch.float32
    one = len(items) == 1
    cat = lambda ts, dim=0: ts[0] if one else torch.cat(ts, dim)
    with _no_autocast(x.device):
        xn = torch.linalg.vector_norm(x2, dim=1, keepdim=True, dtype=f32)  # (T, 1)
        norms = cat([w.norms for w in ws])  # (sum G,)
        # the reference GEMM runs in x's dtype (no copy of x), in fp32 for fp16, whose range
        # a row sum of n outputs can overflow
        xf = x2.float() if x.dtype == torch.float16 else x2
        sums = cat([w.sums for w in ws], 1).to(xf.dtype)  # (K, sum G)
        if all(w.bias is None for w in ws):
            ref = xf @ sums  # (T, sum G)
        else:
            bias = cat([w.norms * 0 if w.bias is None else w.bias for w in ws])
            ref = torch.addmm(bias.to(xf.dtype), xf, sums)
        bound = torch.addcmul(norms, xn, norms)  # (T, sum G)
        per_site = tuple(p.groups // len(p.sites) for p in projs for _ in p.sites)

        def rows_check() -> tuple[Tensor, Tensor, Tensor]:
            """(residual, excess > 0 or NaN where flagged, flagged tokens per site)."""
            rec = cat(
                [
                    y.view(T, p.groups, -1).sum(-1, dtype=f32)
                    for p, y in zip(projs, ys, strict=True)
                ],
                1,
            )
            d = rec - ref  # (T, sum G)
            excess = torch.sub(d.abs(), bound, alpha=factor)
            bad = ~(excess <= 0)
            if len(per_site) == 1:
                return d, excess, bad.any(1).sum(dtype=f32).view(1)
            # tokens flagged per site, one small GEMM for all
            return d, excess, (bad.to(f32) @ _segments(per_site, x.device)).gt(0).sum(0, dtype=f32)

        d, excess, n_rows = rows_check()
        # Columns: one scalar bound per projection, so the largest |column sum| is the worst; the
        # bound gets a 1/64 relative slack for the rounding of the sums themselves.
        xs = (xn.sum() + T) * (1 + 2**-6)
        worst, bad_c = [], []
        for y, w in zip(ys, ws, strict=True):
            e = y.sum(0, dtype=f32).abs()  # (N_i,)
            worst.append(e.max(0, keepdim=True)[1])
            bad_c.append(~(e <= xs * w.total))
        widths = tuple(
            y.shape[-1] // len(p.sites) for p, y in zip(projs, ys, strict=True) for _ in p.sites
        )
        if len(widths) == 1:
            n_cols = bad_c[0].sum(dtype=f32).view(1)
        else:
            n_cols = cat(bad_c).to(f32) @ _segments(widths, x.device)  # (S,)

    # Rows: the R worst tokens, recomputed for every projection of this input.
    top, idx = excess.amax(1).topk(R)  # NaN ranks first
    take = ~(top <= 0)[:, None]  # (R, 1)
    xr = x2.index_select(0, idx)  # (R, K)
    for p, y in zip(projs, ys, strict=True):
        y.index_copy_(0, idx, torch.where(take, p.rows(xr).to(y.dtype), y.index_select(0, idx)))
    # Columns: the worst column of each projection, when it breaks the range bound.
    for p, y, f, flags in zip(projs, ys, worst, bad_c, strict=True):
        hit = flags.index_select(0, f)  # (1,): f is the worst column, flagged or not
        y.index_copy_(1, f, torch.where(hit, p.column(x2, f).to(y.dtype), y.index_select(1, f)))

    # The delivered error: the signed residual of the worst row (INF, NaN, its size).
    value = d.view(-1).index_select(0, excess.view(-1).argmax().view(1)).expand(n_rows.shape[0])
    # Repaired only if every row passes now: a block beyond the budget, a second column, or an
    # input x that was already bad (recomputing repeats the fault) leave rows flagged.
    with _no_autocast(x.device):
        lost = rows_check()[2] > 0
    return _record(n_rows, n_cols, value, lost), ref, bound


# ------------------------------------------------------ heads: scores, probs, context

Recompute = Callable[[Tensor, Tensor], Tensor]  # (b_idx, h_idx) (Kh,) -> (Kh, L, M)


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
    with _no_autocast(s.device):
        ref = (q * k.sum(-2, keepdim=True, dtype=torch.float32)).sum(-1)  # (B, H, L)
        qn = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32)  # (B, H, L)
        kn = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).sum(-1, keepdim=True)
        res = s.sum(-1, dtype=torch.float32) - (ref if alpha == 1.0 else ref * alpha)
        tol = _factor(s, q, k, inner=d, length=Lk) * scale * abs(alpha)
        floor = underflow_floor(s.dtype, length=Lk)
        return res, torch.addcmul(res.abs() - floor, qn, kn, value=-tol)


def probs_residual(p: Tensor, *, scale: float) -> tuple[Tensor, Tensor]:
    """(residual, excess) (B, H, L) of the rows of the probabilities p (B, H, L, Lk): sum to 1."""
    tol = 2 * scale * (unit_roundoff(p.dtype) + (8 + p.shape[-1]) * _U32)
    res = p.sum(-1, dtype=torch.float32) - 1
    return res, res.abs() - tol


def context_residual(
    c: Tensor,
    p: Tensor,
    v: Tensor,
    *,
    scale: float = 1.0,
    v_sums: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """(residual, excess) (B, H, L) of the rows of c = p v (B, H, L, d), from p (B, H, L, Lk) and
    v (B, H, Lk, d). ``v_sums`` = (sum_f v_jf as the V projection check derived it from X and W,
    how far the delivered sums may be from it), both (B, H, Lk); otherwise the sums come from v.
    The bound sum_f |v_jf| always comes from v (p >= 0 is its own magnitude)."""
    Lk, d = v.shape[-2], v.shape[-1]
    with _no_autocast(c.device):
        f32 = torch.float32
        mag = v.abs().sum(-1, dtype=f32)
        if v_sums is None:
            vr = torch.stack([v.sum(-1, dtype=f32), mag], -1)  # (B, H, Lk, 2)
        else:
            vr = torch.stack([v_sums[0], mag, v_sums[1]], -1)  # (B, H, Lk, 3)
        both = p.to(f32) @ vr  # (B, H, L, 2 or 3): reference, bound, passed error
        res = c.sum(-1, dtype=f32) - both[..., 0]
        tol = _factor(c, p, v, inner=Lk, length=d) * scale
        floor = underflow_floor(c.dtype, length=d)
        excess = torch.sub(res.abs() - floor, both[..., 1], alpha=tol)
        return res, excess if v_sums is None else excess - both[..., 2]


@torch.no_grad()
def heads_repair_(
    t: Tensor, residual: Tensor, excess: Tensor, recompute: Recompute, *, max_heads: int
) -> Tensor:
    """Recompute the ``max_heads`` worst flagged matrices of t (B, H, L, M) in place.

    ``excess`` (B, H, L) is > 0 (or NaN) on flagged rows. Returns the (1, 4) record: flagged
    rows over every head, the elements the recompute moved in the worst row of the worst head
    (beyond the last bits of a smaller GEMM), that row's residual, and whether more heads were
    flagged than repaired.
    """
    B, H, L, M = t.shape
    Kh = min(max_heads, B * H)
    top, idx = excess.amax(-1).view(B * H).topk(min(Kh + 1, B * H))  # NaN ranks first
    flagged = ~(top <= 0)
    lost = flagged[Kh] if Kh < B * H else flagged[0] & False
    take, idx = flagged[:Kh], idx[:Kh]
    new = recompute(idx // H, idx % H).to(t.dtype)  # (Kh, L, M)
    t3 = t.data.view(B * H, L, M)
    kept = t3.index_select(0, idx)  # (Kh, L, M)
    t3.index_copy_(0, idx, torch.where(take[:, None, None], new, kept))
    # The worst row (of the worst head): its residual, and what the recompute moved in it.
    j = excess.view(-1).argmax().view(1)  # NaN ranks first; a tensor, never a Python int
    value = residual.view(-1).index_select(0, j)[0]
    r = j % L
    after = new[0].index_select(0, r).float()  # (1, M)
    moved = ~((after - kept[0].index_select(0, r).float()).abs() <= after.abs() * _MOVED)
    rows = (~(excess <= 0)).sum(dtype=torch.float32)
    return _record(rows, moved.sum(dtype=torch.float32), value, lost)


_MOVED = 1e-3
