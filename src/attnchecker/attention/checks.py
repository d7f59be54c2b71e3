"""The checks of protected attention: detect with checksums, repair by recomputing from operands.

Each check compares, per checked vector, a *reference* sum derived from the operands (or from
clean upstream references, see ``passing``) with the sum *recomputed* from the delivered output,
within the rounding-error bound of :mod:`attnchecker.abft.tolerance`. What is flagged is then
repaired by recomputing a fixed number of units from the operands, with the op that produced
them, so no step needs a host synchronisation and a repaired value is what a fault-free run
computes (up to the rounding of a smaller GEMM):

- a projection y = x W^T + b (B, L, N): token rows (per head group) and per-sample feature
  columns are checked; up to ``max_rows`` flagged token rows and one flagged feature are
  recomputed. That repairs one element, a whole token row, a whole feature column and 2D blocks
  spanning up to ``max_rows`` tokens. The column is recomputed over all B * L tokens, as the
  flattened GEMM computes it, so a fault along one output feature of the GEMM is repaired too.
- scores, probabilities and context (B, nh, L, M): query rows are checked; up to ``max_heads``
  flagged (batch, head) matrices are recomputed, which repairs any pattern inside them.

Each check returns an int64 record (:data:`~attnchecker.attention.state.RECORD_FIELDS`).
Repairs write through ``.data``: the repaired tensor may already be saved for backward (softmax
saves its output), and the saved values must become the repaired ones without tripping
autograd's version check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from attnchecker.abft.eec import classify
from attnchecker.abft.tolerance import magnitude_factor, underflow_floor, unit_roundoff

__all__ = [
    "Projection",
    "WeightSums",
    "context_check_",
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
    detected: Tensor, repaired: Tensor, n_rows: Tensor, n_cols: Tensor, kind: Tensor
) -> Tensor:
    corrected = detected & repaired
    parts = [
        detected,
        corrected,
        detected & ~corrected,
        n_rows * detected,
        n_cols * detected,
        kind * detected,
    ]
    return torch.stack([p.long() for p in parts])


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


class WeightSums(NamedTuple):
    """Weight-derived sums, recomputed only when a parameter changes (their ``key``)."""

    key: tuple[int, ...]
    w_abs: Tensor  # (N, K) fp32
    groups: Tensor  # (K, G): column g sums the rows of W in output group g (a head)
    groups_abs: Tensor  # (K, G), the same of |W|
    bias: Tensor  # (N,) fp32, zeros without bias
    bias_groups: Tensor  # (G,)
    bias_groups_abs: Tensor  # (G,)


def weight_sums(proj: Projection, n_groups: int, cached: WeightSums | None) -> WeightSums:
    w, b = proj.weight, proj.bias
    key = (w.data_ptr(), w._version, -1 if b is None else b._version, n_groups)
    if cached is not None and cached.key == key:
        return cached
    with torch.no_grad(), _no_autocast(w.device):
        N, K = w.shape
        w32 = w.float()
        w_abs = w32.abs()
        groups = w32.view(n_groups, N // n_groups, K).sum(1).T.contiguous()  # (K, G)
        groups_abs = w_abs.view(n_groups, N // n_groups, K).sum(1).T.contiguous()
        b32 = torch.zeros(N, device=w.device) if b is None else b.float()
        b_groups = b32.view(n_groups, -1).sum(-1)
        b_groups_abs = b32.abs().view(n_groups, -1).sum(-1)
    return WeightSums(key, w_abs, groups, groups_abs, b32, b_groups, b_groups_abs)


class ProjectionRefs(NamedTuple):
    """Clean references a projection check leaves for downstream checks (checksum passing)."""

    col_ref: Tensor  # (B, N): per-sample token sums of y, from x and W
    col_mag: Tensor  # (B, N): their magnitude bound (>= per-sample token sums of |y|)
    row_ref: Tensor  # (B, L, G): per-token, per-group feature sums of y
    row_mag: Tensor  # (B, L, G): >= per-token, per-group sums of |y|


@torch.no_grad()
def projection_check_(
    y: Tensor,
    x: Tensor,
    proj: Projection,
    sums: WeightSums,
    *,
    max_rows: int,
    parts: int = 1,
    scale: float = 1.0,
) -> tuple[list[Tensor], ProjectionRefs]:
    """Check y (B, L, N) = x (B, L, K) W^T + b and repair it in place; see the module docstring.

    ``parts`` splits the features into equal consecutive parts (a fused Q|K|V projection) that
    get one record each; the repair is shared.
    """
    B, L, N = y.shape
    K = x.shape[-1]
    G = sums.groups.shape[-1]
    with _no_autocast(y.device):
        x32 = x.float()
        x_abs = x32.abs()
        col_ref = x32.sum(1) @ proj.weight.float().T + L * sums.bias  # (B, K) @ (K, N) -> (B, N)
        col_mag = x_abs.sum(1) @ sums.w_abs.T + L * sums.bias.abs()
        row_ref = x32 @ sums.groups + sums.bias_groups  # (B, L, K) @ (K, G) -> (B, L, G)
        row_mag = x_abs @ sums.groups_abs + sums.bias_groups_abs
    col_rec = y.sum(1, dtype=torch.float32)  # (B, N)
    row_rec = y.view(B, L, G, N // G).sum(-1, dtype=torch.float32)  # (B, L, G)
    col_tol = _factor(y, x, proj.weight, inner=K, length=L) * scale * col_mag
    col_tol += underflow_floor(y.dtype, length=L)
    row_tol = _factor(y, x, proj.weight, inner=K, length=N // G) * scale * row_mag
    row_tol += underflow_floor(y.dtype, length=N // G)
    bad_c = _bad(col_ref, col_rec, col_tol)  # (B, N)
    bad_rg = _bad(row_ref, row_rec, row_tol)  # (B, L, G)
    bad_r = bad_rg.any(-1)  # (B, L)
    n_rows = bad_r.sum()

    y2, x2 = y.data.view(B * L, N), x.reshape(B * L, K)
    flat_r, flat_c = bad_r.view(-1), bad_c.view(-1)
    t0, j = flat_r.to(torch.uint8).argmax(), flat_c.to(torch.uint8).argmax()  # first flagged
    kind = classify(y2.view(-1).index_select(0, (t0 * N + j % N).view(1))).long()[0]
    # Token rows: the first max_rows flagged ones (any rows when fewer are flagged).
    R = min(max_rows, B * L)
    rows = flat_r.to(torch.uint8).topk(R, sorted=False).indices  # (R,)
    take = flat_r.index_select(0, rows)[:, None]  # (R, 1)
    new_rows = proj.compute(x2.index_select(0, rows), None).to(y.dtype)  # (R, N)
    y2.index_copy_(0, rows, torch.where(take, new_rows, y2.index_select(0, rows)))
    row_sums = new_rows.view(R, G, N // G).sum(-1, dtype=torch.float32)  # (R, G)
    pick = lambda t: t.reshape(B * L, G).index_select(0, rows)
    rows_ok = ~_bad(pick(row_ref), row_sums, pick(row_tol))
    rows_fixed = (n_rows >= 1) & (n_rows <= R) & (rows_ok.all(-1) | ~take[:, 0]).all()
    # One feature column, over every token of every sample: the first flagged feature.
    cols_bad = bad_c.any(0)  # (N,)
    f = cols_bad.to(torch.uint8).argmax()
    new_col = proj.compute(x2, f.view(1)).to(y.dtype)  # (B*L, 1)
    f = f.view(1)  # index tensors, never Python ints: converting one would synchronise
    fixed = torch.where(cols_bad.index_select(0, f), new_col, y2.index_select(1, f))
    y2.index_copy_(1, f, fixed)
    col_sums = new_col.view(B, L).sum(-1, dtype=torch.float32)  # (B,)
    col_ok = ~_bad(col_ref.index_select(1, f)[:, 0], col_sums, col_tol.index_select(1, f)[:, 0])
    col_fixed = (cols_bad.sum() == 1) & col_ok.all()

    # Repaired: every flagged row recomputed, or the one flagged feature, and the recomputed
    # values match their references (they do not when the input itself was bad).
    repaired = rows_fixed | col_fixed
    records = []
    for bad_cols, bad_groups in zip(
        cols_bad.chunk(parts, -1), bad_rg.chunk(parts, -1), strict=True
    ):
        nr, nc = bad_groups.any(-1).sum(), bad_cols.sum()  # tokens, features of the flat GEMM
        records.append(_record((nr + nc) > 0, repaired, nr, nc, kind))
    return records, ProjectionRefs(col_ref, col_mag + col_tol, row_ref, row_mag + row_tol)


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
    # The pattern and kind of the first candidate: elements that moved beyond their row's tolerance.
    tol0 = tol.view(B * H, -1).index_select(0, idx[:1])[0]  # (L,): rows of the first candidate
    moved = ~((new[0].float() - old[0].float()).abs() <= tol0[:, None])  # (L, M)
    worst = moved.view(-1).to(torch.uint8).argmax().view(1)
    kind = classify(old[0].reshape(-1).index_select(0, worst)).long()[0]
    ref_k = ref if isinstance(ref, float) else ref.view(B * H, -1).index_select(0, idx)  # (Kh, L)
    ok = ~_bad(ref_k, new.sum(-1, dtype=torch.float32), tol.view(B * H, -1).index_select(0, idx))
    n_heads = head_bad.sum()
    repaired = (n_heads <= Kh) & (ok.all(-1) | ~take).all()
    return _record(n_heads > 0, repaired, moved.any(-1).sum(), moved.any(-2).sum(), kind)


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
) -> Tensor:
    """Check s = alpha q k^T (B, H, L, Lk) from q (B, H, L, d) and k (B, H, Lk, d), by rows."""
    d, Lk = q.shape[-1], k.shape[-2]
    with _no_autocast(s.device):
        q32, k32 = q.float(), k.float()
        ref = (k32.sum(-2)[..., None, :] @ q32.mT).squeeze(
            -2
        ) * alpha  # (B,H,1,d) @ (B,H,d,L) -> (B,H,L)
        mag = (k32.abs().sum(-2)[..., None, :] @ q32.abs().mT).squeeze(-2) * abs(alpha)
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
    c: Tensor, p: Tensor, v: Tensor, *, recompute: Recompute, max_heads: int, scale: float = 1.0
) -> Tensor:
    """Check c = p v, (B, H, L, d) from probabilities p (B, H, L, Lk) and v (B, H, Lk, d), per row.

    p is non-negative (softmax, then dropout's scaling), so it is its own magnitude: one pass
    over p yields the reference and its bound together.
    """
    Lk, d = v.shape[-2], v.shape[-1]
    with _no_autocast(c.device):
        v32 = v.float()
        sums = torch.stack([v32.sum(-1), v32.abs().sum(-1)], -2)  # (B, H, 2, Lk)
        both = sums @ p.float().mT  # (B, H, 2, Lk) @ (B, H, Lk, L) -> (B, H, 2, L)
    ref, mag = both.unbind(-2)
    rec = c.sum(-1, dtype=torch.float32)
    tol = _factor(c, p, v, inner=Lk, length=d) * scale * mag + underflow_floor(c.dtype, length=d)
    return _repair_heads_(c, ref, tol, _bad(ref, rec, tol), recompute, max_heads)
