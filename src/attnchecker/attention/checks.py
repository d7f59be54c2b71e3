"""The checks of protected attention: detect with checksums, repair by recomputing from operands.

Each check compares, per checked vector, a *reference* sum derived from the operands with the
sum *recomputed* from the delivered output, within the rounding-error bound of
:mod:`attnchecker.abft.tolerance` (its magnitudes may come from the projections: ``passing``).
What is flagged is then repaired by recomputing a fixed number of units from the operands, with
the op that produced them, so no step needs a host synchronisation and a repaired value is what
a fault-free run computes (up to the rounding of a smaller GEMM):

- a projection y = x W^T + b (B, L, N): every token row is checked against x_t . (W^T 1) + sum(b)
  (per part of a fused Q|K|V), and every feature column gets a reference-free range check that
  locates extreme whole-column errors; up to ``max_rows`` flagged token rows and the first
  flagged feature are recomputed. That repairs one element, a whole token row, a whole feature
  column and 2D blocks spanning up to ``max_rows`` tokens. The column is recomputed over all
  B * L tokens, as the flattened GEMM computes it, so a fault along one output feature of the
  GEMM is repaired too.
- scores, probabilities and context (B, nh, L, M): query rows are checked; up to ``max_heads``
  flagged (batch, head) matrices are recomputed, which repairs any pattern inside them.

Each check returns a float64 record (:data:`~attnchecker.attention.state.RECORD_FIELDS`).
Repairs write through ``.data``: the repaired tensor may already be saved for backward (softmax
saves its output), and the saved values must become the repaired ones without tripping
autograd's version check.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from attnchecker.abft.tolerance import magnitude_factor, underflow_floor, unit_roundoff

__all__ = [
    "InputSums",
    "Projection",
    "ProjectionBounds",
    "WeightSums",
    "context_check_",
    "input_sums",
    "probs_check_",
    "projection_check_",
    "scores_check_",
    "weight_sums",
]

_U32 = unit_roundoff(torch.float32)


def _no_autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, enabled=False)


def _bad(ref: Tensor | float, rec: Tensor, tol: Tensor) -> Tensor:
    return ~((ref - rec).abs() <= tol)  # NaN compares False: flagged


def _factor(out: Tensor, *operands: Tensor, inner: int, length: int) -> float:
    """Tolerance factor; operands wider than the output (autocast) were rounded to its dtype
    before the GEMM, which adds one rounding of each operand to every product."""
    rounded = sum(op.dtype != out.dtype for op in operands)
    return magnitude_factor(
        out.dtype, out.device, inner=inner, length=length
    ) + rounded * unit_roundoff(out.dtype)


def _record(
    detected: Tensor, repaired: Tensor, n_rows: Tensor, n_cols: Tensor, value: Tensor
) -> Tensor:
    """The float64 record of one check (:data:`~attnchecker.attention.state.RECORD_FIELDS`); the
    delivered value is kept raw and classified (INF, NaN, near-INF...) only when drained."""
    parts = (detected, detected & repaired, n_rows, n_cols, value)
    return torch.stack([t.to(torch.float64) for t in parts])


# --------------------------------------------------------------------------------- projections


class Projection(NamedTuple):
    """A projection y = x W^T + b as the check sees it.

    ``compute(x_rows, features)`` must compute output rows for input rows x_rows (T, K) exactly as
    the module does (same op, so the same dtype under autocast), restricted to the output
    ``features`` (an index tensor) when given.
    """

    weight: Tensor  # (N, K); for a Conv1D, a transposed view of its (K, N) parameter
    bias: Tensor | None  # (N,)
    compute: Callable[[Tensor, Tensor | None], Tensor]


class _Ident:
    """Identity of a tensor that does not keep it alive: a freed tensor's memory is reused at
    once, so its address cannot key a cache."""

    __slots__ = ("ref",)

    def __init__(self, t: Tensor | None) -> None:
        self.ref = None if t is None else weakref.ref(t)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Ident):
            return False
        if self.ref is None or other.ref is None:
            return self.ref is other.ref
        a = self.ref()
        return a is not None and a is other.ref()

    __hash__ = None  # type: ignore[assignment]


class WeightSums(NamedTuple):
    """Weight-derived sums, recomputed only when a parameter changes (their ``key``). A fused
    projection has P equal parts (Q|K|V); G head groups split the outputs for the bounds."""

    key: tuple[object, ...]
    row_sums: tuple[Tensor, ...]  # P x (K,): W summed over a part's outputs
    bias_parts: Tensor  # (P,): b summed over a part's outputs
    norm_parts: Tensor  # (P,): sum of ||W_o||_2 over a part's outputs o
    abs_bias_parts: Tensor  # (P,): sum of |b_o| over a part's outputs
    norms: Tensor  # (N,): ||W_o||_2 of every output o
    abs_bias: Tensor  # (N,)
    head_norms: Tensor  # (G,): sum of ||W_o||_2 over a head group
    head_abs_bias: Tensor  # (G,)


def weight_sums(
    proj: Projection, n_groups: int, parts: int, cached: WeightSums | None
) -> WeightSums:
    w, b = proj.weight, proj.bias
    key = (_Ident(w), w._version, _Ident(b), -1 if b is None else b._version, n_groups, parts)
    if cached is not None and cached.key == key:
        return cached
    with torch.no_grad(), _no_autocast(w.device):
        N, K = w.shape
        w32 = w.float()
        norms = torch.linalg.vector_norm(w32, dim=1)  # (N,)
        bias = torch.zeros(N, device=w.device) if b is None else b.float()
        row_sums = tuple(w32.view(parts, -1, K).sum(1))  # P x (K,)
        by_part = lambda t: t.view(parts, -1).sum(-1)
        by_head = lambda t: t.view(n_groups, -1).sum(-1)
        return WeightSums(
            key,
            row_sums,
            by_part(bias),
            by_part(norms),
            by_part(bias.abs()),
            norms,
            bias.abs(),
            by_head(norms),
            by_head(bias.abs()),
        )


class InputSums(NamedTuple):
    """What the checks need from a projection input x (B, L, K), shared by Q, K and V."""

    key: tuple[object, ...]
    norms: Tensor  # (B * L, 1): ||x_t||_2 of every token
    sample_norms: Tensor  # (B, 1): summed over each sample's tokens
    total_norm: Tensor  # (): summed over all tokens


def input_sums(x: Tensor, cached: InputSums | None) -> InputSums:
    key = (_Ident(x), x._version)
    if cached is not None and cached.key == key:
        return cached
    with torch.no_grad(), _no_autocast(x.device):
        norms = torch.linalg.vector_norm(x.float(), dim=-1)  # (B, L)
        return InputSums(key, norms.view(-1, 1), norms.sum(1, keepdim=True), norms.sum())


class ProjectionBounds(NamedTuple):
    """Magnitude bounds a projection check leaves for the attention checks (``mode="passing"``):
    by Cauchy-Schwarz, sum_k |x_tk| |W_ok| <= ||x_t|| ||W_o||, so without touching y:"""

    head_rows: Tensor  # (B, L, G): >= sum over the outputs o of head g of |y_to|
    features: Tensor  # (B, N): >= sum over the tokens of one sample of |y_to|


@torch.no_grad()
def projection_check_(
    y: Tensor,
    x: Tensor,
    proj: Projection,
    w_sums: WeightSums,
    x_sums: InputSums,
    *,
    max_rows: int,
    scale: float = 1.0,
) -> tuple[list[Tensor], ProjectionBounds]:
    """Check y (B, L, N) = x (B, L, K) W^T + b and repair it in place; see the module docstring.

    Rows: every token's sum over each part's outputs against x_t . (W^T 1) + sum(b), within the
    rounding bound. Columns: a range check that needs no reference: a feature whose sum over
    all tokens exceeds the bound on sum_t |y_to| holds an error that large (INF, NaN, near-INF);
    it locates whole-column errors, which flag every row. Each of the P parts (Q|K|V of a fused
    projection) gets its own record.
    """
    B, L, N = y.shape
    K, P = x.shape[-1], len(w_sums.row_sums)
    y2, x2 = y.data.view(B * L, N), x.reshape(B * L, K)
    with _no_autocast(y.device):
        x32 = x2.float()
        row_ref = torch.stack([x32 @ r for r in w_sums.row_sums], -1) + w_sums.bias_parts  # (BL, P)
    factor = _factor(y, x, proj.weight, inner=K, length=N // P) * scale
    row_tol = (x_sums.norms * w_sums.norm_parts + w_sums.abs_bias_parts) * factor
    row_tol += underflow_floor(y.dtype, length=N // P)
    col_mag = x_sums.total_norm * w_sums.norms + (B * L) * w_sums.abs_bias  # (N,)

    def row_flags() -> Tensor:  # (B*L, P)
        return _bad(row_ref, y2.view(B * L, P, N // P).sum(-1, dtype=torch.float32), row_tol)

    bad_rp = row_flags()
    bad_r = bad_rp.any(-1)  # (B*L,)
    bad_c = ~(y2.sum(0, dtype=torch.float32).abs() <= col_mag)  # (N,): NaN compares False
    bad_r8, bad_c8 = bad_r.to(torch.uint8), bad_c.to(torch.uint8)
    value = y2.view(-1).index_select(0, (bad_r8.argmax() * N + bad_c8.argmax()).view(1))[0]

    # Token rows: the first max_rows flagged ones (any rows when fewer are flagged).
    R = min(max_rows, B * L)
    rows = bad_r8.topk(R, sorted=False).indices  # (R,)
    new_rows = proj.compute(x2.index_select(0, rows), None).to(y.dtype)  # (R, N)
    take = bad_r.index_select(0, rows)[:, None]
    y2.index_copy_(0, rows, torch.where(take, new_rows, y2.index_select(0, rows)))
    # One feature column over every token (the flattened GEMM's column): the first flagged.
    f = bad_c8.argmax().view(1)  # index tensors, never Python ints: those would synchronise
    new_col = proj.compute(x2, f).to(y.dtype)  # (B*L, 1)
    y2.index_copy_(1, f, torch.where(bad_c.index_select(0, f), new_col, y2.index_select(1, f)))
    # Repaired only if the rows now pass (they do not when x itself was bad: an upstream fault).
    n_rows, n_cols = bad_r.sum(), bad_c.sum()
    repaired = ~row_flags().any() & ((n_rows <= R) | (n_cols == 1))
    records = []
    for p, cols in enumerate(bad_c.chunk(P)):
        nr, nc = bad_rp[:, p].sum(), cols.sum()
        records.append(_record((nr + nc) > 0, repaired, nr, nc, value))
    head_rows = x_sums.norms.view(B, L, 1) * w_sums.head_norms + w_sums.head_abs_bias
    features = x_sums.sample_norms * w_sums.norms + L * w_sums.abs_bias
    return records, ProjectionBounds(head_rows, features)


# ------------------------------------------------------ heads: scores, probs, context

Recompute = Callable[[Tensor, Tensor], Tensor]  # (b_idx, h_idx) (Kh,) -> (Kh, L, M)


def _repair_heads_(
    t: Tensor, ref: Tensor | float, tol: Tensor, bad: Tensor, recompute: Recompute, max_heads: int
) -> Tensor:
    """Recompute up to ``max_heads`` flagged matrices of t (B, H, L, M); ref, tol, bad: (B, H, L).

    A repair counts only if the recomputed rows match their references: they do not when an
    operand was already bad (a fault upstream that could not be repaired).
    """
    B, H = t.shape[:2]
    head_bad = bad.any(-1).view(-1)  # (B*H,)
    Kh = min(max_heads, B * H)
    idx = head_bad.to(torch.uint8).topk(Kh).indices  # flagged first, largest index order irrelevant
    b_idx, h_idx = idx // H, idx % H
    old = t.data[b_idx, h_idx]  # (Kh, L, M)
    new = recompute(b_idx, h_idx).to(t.dtype)
    take = head_bad.index_select(0, idx)
    t.data[b_idx, h_idx] = torch.where(take[:, None, None], new, old)
    # The pattern of the first candidate: elements that moved beyond their row's tolerance.
    tol0 = tol.reshape(B * H, -1).index_select(0, idx[:1])[0]  # (L,): rows of the first candidate
    moved = ~((new[0].float() - old[0].float()).abs() <= tol0[:, None])  # (L, M)
    worst = moved.view(-1).to(torch.uint8).argmax().view(1)
    value = old[0].reshape(-1).index_select(0, worst)[0]
    ref_k = (
        ref if isinstance(ref, float) else ref.reshape(B * H, -1).index_select(0, idx)
    )  # (Kh, L)
    ok = ~_bad(ref_k, new.sum(-1, dtype=torch.float32), tol.reshape(B * H, -1).index_select(0, idx))
    n_heads = head_bad.sum()
    repaired = (n_heads <= Kh) & (ok.all(-1) | ~take).all()
    return _record(n_heads > 0, repaired, moved.any(-1).sum(), moved.any(-2).sum(), value)


def _rowdot(x: Tensor, v: Tensor) -> Tensor:
    """Every row of x (B, H, L, d) dotted with v (B, H, d): (B, H, L). Elementwise, so that the
    head-strided views attention works on are read in place (a matmul would copy them)."""
    return (x * v[:, :, None, :]).sum(-1)


@torch.no_grad()
def scores_check_(
    s: Tensor,
    q: Tensor,
    k: Tensor,
    *,
    alpha: float,
    recompute: Recompute,
    max_heads: int,
    scale: float = 1.0,
    bounds: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Check s = alpha q k^T (B, H, L, Lk) from q (B, H, L, d) and k (B, H, Lk, d), by rows.

    Reference: sum_j s_ij = alpha q_i . sum_j k_j. Magnitude: sum_j sum_f |q_if| |k_jf|, from
    the operands, or bounded without touching them by ``bounds`` = (q_rows (B, H, L) >= sum_f
    |q_if| per head, k_max (B, H) >= max_f sum_j |k_jf|), which the projections leave behind.
    """
    d, Lk = q.shape[-1], k.shape[-2]
    with _no_autocast(s.device):
        q32, k32 = q.float(), k.float()
        ref = _rowdot(q32, k32.sum(-2)) * alpha  # (B, H, L)
        if bounds is None:
            mag = _rowdot(q32.abs(), k32.abs().sum(-2)) * abs(alpha)
        else:
            mag = bounds[0] * bounds[1][..., None] * abs(alpha)
    rec = s.sum(-1, dtype=torch.float32)  # (B, H, L)
    tol = _factor(s, q, k, inner=d, length=Lk) * scale * mag + underflow_floor(s.dtype, length=Lk)
    return _repair_heads_(s, ref, tol, _bad(ref, rec, tol), recompute, max_heads)


@torch.no_grad()
def probs_check_(p: Tensor, *, recompute: Recompute, max_heads: int, scale: float = 1.0) -> Tensor:
    """Check softmax probabilities p (B, H, L, Lk): every row sums to 1.

    Each element carries a few roundings relative to itself (exp, normalisation: bounded by 8
    u_fp32) and one rounding to p's dtype; they sum to at most (8 u_fp32 + u_p) over a row whose
    exact sum is 1; the fp32 recomputed sum adds Lk u_fp32. Every single-element change beyond
    that moves the row sum, which is why the [0, 1] range is not scanned separately (a scan costs
    a full extra pass and catches only compensating multi-element errors).
    """
    Lk = p.shape[-1]
    rec = p.sum(-1, dtype=torch.float32)
    tol = torch.full_like(rec, 2 * scale * (unit_roundoff(p.dtype) + (8 + Lk) * _U32))
    return _repair_heads_(p, 1.0, tol, _bad(1.0, rec, tol), recompute, max_heads)


@torch.no_grad()
def context_check_(
    c: Tensor,
    p: Tensor,
    v: Tensor,
    *,
    recompute: Recompute,
    max_heads: int,
    scale: float = 1.0,
    v_rows: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Check c = p v, (B, H, L, d) from probabilities p (B, H, L, Lk) and v (B, H, Lk, d), by rows.

    Reference: sum_f c_if = sum_j p_ij (sum_f v_jf); p is non-negative (softmax, then dropout's
    scaling), so it is its own magnitude and one pass over p gives the reference and its bound.
    ``v_rows`` = (sum_f v_jf, a bound on sum_f |v_jf|), both (B, H, Lk), when the V projection
    check has them; otherwise they come from v.
    """
    Lk, d = v.shape[-2], v.shape[-1]
    with _no_autocast(c.device):
        if v_rows is None:
            v32 = v.float()
            v_rows = (v32.sum(-1), v32.abs().sum(-1))
        both = (
            torch.stack(v_rows, -2) @ p.float().mT
        )  # (B, H, 2, Lk) @ (B, H, Lk, L) -> (B, H, 2, L)
    ref, mag = both.unbind(-2)
    rec = c.sum(-1, dtype=torch.float32)
    tol = _factor(c, p, v, inner=Lk, length=d) * scale * mag + underflow_floor(c.dtype, length=d)
    return _repair_heads_(c, ref, tol, _bad(ref, rec, tol), recompute, max_heads)
