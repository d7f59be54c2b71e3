"""Verify a product against its reference checksums, locate and correct errors (EEC).

Contract of :func:`correct_`: given the delivered C (..., M, N) and its reference
:class:`~attnchecker.abft.checksum.Checksums`, it

1. flags every row / column whose plain or weighted checksum differs from the reference by more
   than its tolerance (INF and NaN propagate into the sums, so they are always flagged);
2. classifies each matrix of the batch: 0D (at most one bad row and one bad column), 1R (one
   bad row, several bad columns), 1C (several bad rows, one bad column), 2D or several bad
   vectors in a one-direction check (uncorrectable), or bad operands (the reference itself is
   not finite: uncorrectable here);
3. corrects in place. With the operands at hand (the normal case: ``protected_matmul`` and the
   attention pipeline keep them), each corrected value is recomputed from them: row i of A times
   column j of B for a 0D element, row i of A times B for a whole bad row (1R), A times column j
   of B for a whole bad column (1C). Column-wise reconstruction of a bad row would need the sums
   of every column without that row, a full pass over C; the rebuild costs one vector-matrix
   product and is exact. Without operands, a 0D element is reconstructed from its row's
   reference checksum and the other elements of the row (EEC; a masked sum that excludes it,
   so INF - INF never occurs);
4. re-verifies the corrected row and column (plain and weighted sums) and keeps a correction
   only if both agree with their references. A wrong location therefore never passes silently:
   the matrix is reported uncorrectable and left as delivered. A rebuilt value is exact up to
   rounding, so its check uses the plain tolerance and any error left elsewhere in the vector
   must be below it; a reconstructed value is itself known only to within the row's tolerance,
   which the check must allow (the weighted sum sees it pos + 1 times), so without operands a
   second, smaller error in the same vector can be absorbed into the correction.

Everything is fixed-size tensor work per matrix (one candidate row and one candidate column are
gathered, fixed and scattered back): no ``.item()``, no branch on tensor values, no host
synchronisation. The :class:`Report` holds tensors; call :meth:`Report.summary` when a sync is
acceptable.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import Tensor

from attnchecker.abft.checksum import BOTH, ROWS, Checksums, recompute, weights

__all__ = ["NEAR_INF", "Pattern", "Report", "ValueKind", "correct_"]

NEAR_INF = 1e10
"""A finite value of at least this magnitude is classified as near-INF (the reference rule)."""


class Pattern(enum.IntEnum):
    """Shape of the errors found in one matrix."""

    NONE = 0
    D0 = 1  # one element
    R1 = 2  # one row, several columns
    C1 = 3  # one column, several rows
    D2 = 4  # several rows and several columns
    MULTI = 5  # several bad vectors in a one-direction check
    OPERAND = 6  # the reference checksum itself is not finite: the operands were bad


class ValueKind(enum.IntEnum):
    """What the delivered value at the located position looked like."""

    NONE = 0
    POS_INF = 1
    NEG_INF = 2
    NAN = 3
    NEAR_INF = 4
    FINITE = 5


class Report(NamedTuple):
    """Per-matrix detection results (batch shape ``...`` of C), all tensors on C's device."""

    detected: Tensor  # (...) bool
    corrected: Tensor  # (...) bool: corrected and re-verified
    pattern: Tensor  # (...) int8 Pattern
    kind: Tensor  # (...) int8 ValueKind of the delivered value at (row, col)
    row: Tensor  # (...) int64 located row (meaningful when detected)
    col: Tensor  # (...) int64 located column
    bad_rows: Tensor | None  # (..., M) bool, None when rows were not checked
    bad_cols: Tensor | None  # (..., N) bool, None when columns were not checked

    @property
    def uncorrectable(self) -> Tensor:
        return self.detected & ~self.corrected

    def counts(self) -> dict[str, Tensor]:
        """0-dim int64 tensors: no host sync."""
        return {
            "detected": self.detected.sum(),
            "corrected": self.corrected.sum(),
            "uncorrectable": self.uncorrectable.sum(),
        }

    def summary(self) -> dict[str, int]:
        """Counts as Python ints (synchronises with the device)."""
        return {k: int(v) for k, v in self.counts().items()}


def _classify(x: Tensor) -> Tensor:
    kind = torch.full_like(x, ValueKind.FINITE, dtype=torch.int8)
    kind = torch.where(x.abs() >= NEAR_INF, ValueKind.NEAR_INF, kind)
    kind = torch.where(x == float("inf"), ValueKind.POS_INF, kind)
    kind = torch.where(x == float("-inf"), ValueKind.NEG_INF, kind)
    return torch.where(x.isnan(), ValueKind.NAN, kind).to(torch.int8)


def _gather_row(t: Tensor, i: Tensor) -> Tensor:
    """t (..., M, N), i (...) -> row i of each matrix, (..., N)."""
    idx = i[..., None, None].expand(*i.shape, 1, t.shape[-1])  # (..., 1, N)
    return t.gather(-2, idx).squeeze(-2)


def _gather_col(t: Tensor, j: Tensor) -> Tensor:
    """t (..., M, N), j (...) -> column j of each matrix, (..., M)."""
    idx = j[..., None, None].expand(*j.shape, t.shape[-2], 1)  # (..., M, 1)
    return t.gather(-1, idx).squeeze(-1)


def _pick(t: Tensor, i: Tensor) -> Tensor:
    """t (..., n), i (...) -> t[..., i] (...)."""
    return t.gather(-1, i[..., None]).squeeze(-1)


def _put(t: Tensor, i: Tensor, v: Tensor) -> Tensor:
    """Out of place t[..., i] = v for t (..., n), i (...), v (...)."""
    return t.scatter(-1, i[..., None], v[..., None])


def _first(mask: Tensor) -> Tensor:
    """Index of the first True along the last dim (0 when there is none)."""
    return mask.to(torch.uint8).argmax(-1)


def _locate(vec: Tensor, d: Tensor, tol: Tensor) -> tuple[Tensor, Tensor]:
    """Where is the single bad element of each vector (..., n)? Returns (index, reliable), (...).

    d (..., 2) and tol (..., 2) are the vector's plain and weighted checksum differences and
    tolerances. A non-finite element is its own location. Otherwise d_w / d_1 = loc + 1 up to
    (tol_w + n tol_1) / |d_1|, so the ratio is trusted only when |d_1| > 2 (tol_w + n tol_1);
    if the weighted difference overflowed, the element of largest magnitude is the blown-up one.
    """
    n = vec.shape[-1]
    finite = vec.isfinite()
    all_finite = finite.all(-1)
    loudest = torch.where(finite, vec.abs(), float("inf")).argmax(-1)  # (...)
    ratio = d[..., 1] / d[..., 0]
    loc = ratio.round() - 1
    in_range = loc.isfinite() & (loc >= 0) & (loc <= n - 1)
    sharp = d[..., 0].abs() > 2 * (tol[..., 1] + n * tol[..., 0])
    overflowed = d[..., 0].isfinite() & ~d[..., 1].isfinite()
    loc = loc.nan_to_num(0.0, 0.0, 0.0).clamp(0, n - 1).long()
    use_ratio = all_finite & in_range & sharp
    reliable = ~all_finite | use_ratio | (all_finite & overflowed)
    return torch.where(use_ratio, loc, loudest), reliable


def _verified(vec: Tensor, ref: Tensor, tol: Tensor, pos: Tensor, slack: Tensor | float) -> Tensor:
    """Does the corrected vec (..., n) match its reference sums ref (..., 2) within tol (..., 2)?

    The element at ``pos`` (...) was replaced by a value known to within ``slack`` (...), which
    the plain sum sees once and the weighted sum (pos + 1) times.
    """
    sums = vec @ weights(vec.shape[-1], vec.device).T  # (..., n) @ (n, 2) -> (..., 2)
    slack = torch.as_tensor(slack, device=vec.device).expand(pos.shape)
    extra = torch.stack([slack, slack * (pos + 1)], -1)  # (..., 2)
    return ((ref - sums).abs() <= tol + extra).all(-1)


def _transpose(sums: Checksums) -> Checksums:
    t = lambda x: None if x is None else x.mT
    return Checksums(t(sums.cols), t(sums.rows), t(sums.col_tol), t(sums.row_tol))


@torch.no_grad()
def correct_(
    c: Tensor, sums: Checksums, a: Tensor | None = None, b: Tensor | None = None
) -> Report:
    """Verify C = a @ b against ``sums`` and correct it in place; see the module docstring.

    c: (..., M, N). ``a`` (..., M, K) and ``b`` (..., K, N) are optional: with them, whole rows
    and columns (1R, 1C) can be rebuilt; without them only 0D errors are corrected.
    """
    if sums.rows is None and sums.cols is None:
        raise ValueError("sums holds neither row nor column checksums")
    if sums.rows is None:  # columns only: work on C^T = b^T a^T, whose rows are C's columns
        rep = correct_(
            c.mT, _transpose(sums), None if b is None else b.mT, None if a is None else a.mT
        )
        return rep._replace(row=rep.col, col=rep.row, bad_rows=None, bad_cols=rep.bad_rows)
    has_cols = sums.cols is not None
    check = BOTH if has_cols else ROWS
    M, N = c.shape[-2], c.shape[-1]
    batch = c.shape[:-2]
    rows, cols = recompute(c, check=check)

    d_row = sums.rows - rows  # (..., M, 2)
    bad_row = ~(d_row.abs() <= sums.row_tol).all(-1)  # (..., M); NaN compares False: bad
    n_row = bad_row.sum(-1)  # (...)
    ref_ok = sums.rows.isfinite().all(-1).all(-1)  # (...)
    zero = torch.zeros(batch, dtype=torch.long, device=c.device)
    if has_cols:
        d_col = sums.cols - cols  # (..., 2, N)
        bad_col = ~(d_col.abs() <= sums.col_tol).all(-2)  # (..., N)
        n_col = bad_col.sum(-1)
        ref_ok &= sums.cols.isfinite().all(-1).all(-1)
    else:
        n_col = zero

    # Candidate position (i, j): the first bad row and column; where one direction saw nothing
    # (an error below its tolerance, or no column check), locate within the other's vector.
    i = _first(bad_row)
    j, sure = _locate(
        _gather_row(c, i).float(), _gather_row(d_row, i), _gather_row(sums.row_tol, i)
    )
    if has_cols:
        j_col = _first(bad_col)
        i_in, sure_in = _locate(
            _gather_col(c, j_col).float(),
            _gather_col(d_col, j_col),
            _gather_col(sums.col_tol, j_col),
        )
        sure = torch.where(n_col > 0, torch.where(n_row > 0, True, sure_in), sure)
        j = torch.where(n_col > 0, j_col, j)
        i = torch.where(n_row > 0, i, i_in)
    row = _gather_row(c, i).float()  # (..., N)
    x_old = _pick(row, j)  # (...)
    row_ref, row_tol = _gather_row(sums.rows, i), _gather_row(sums.row_tol, i)  # (..., 2)

    have_ops = a is not None and b is not None
    fixable = (n_row <= 1) & (n_col <= 1) & sure
    if have_ops:
        # Values from the operands: row i of A times B (and column j), exact up to rounding.
        a_b = a.expand(*batch, M, a.shape[-1])  # (..., M, K)
        b_b = b.expand(*batch, b.shape[-2], N)  # (..., K, N)
        row_ab = (_gather_row(a_b, i)[..., None, :] @ b_b).squeeze(-2).float()  # (..., N)
        x_new = _pick(row_ab, j)
        slack: Tensor | float = 0.0
    else:
        # EEC: reconstruct from the row's reference and the other elements of the row (masked,
        # so INF - INF never occurs). The result is known only to within the row's tolerance.
        others = torch.where(torch.arange(N, device=c.device) == j[..., None], 0.0, row).sum(-1)
        x_new = row_ref[..., 0] - others  # (...)
        slack = row_tol[..., 0]
    new_row = row
    if has_cols:
        col = _gather_col(c, j).float()  # (..., M)
        new_col = col
        if have_ops:
            # 1R / 1C: the one bad row (column) is rebuilt whole, so that an error below the
            # other direction's tolerance does not survive either.
            col_ab = (a_b @ _gather_col(b_b, j)[..., None]).squeeze(-1).float()  # (..., M)
            is_1r = (n_row == 1) & (n_col >= 2)
            is_1c = (n_row >= 2) & (n_col == 1)
            new_row = torch.where(is_1r[..., None], row_ab, row)
            new_col = torch.where(is_1c[..., None], col_ab, col)
            x_new = torch.where(is_1c, _pick(col_ab, i), x_new)
            fixable |= is_1r | is_1c
    # Round to C's dtype first, so that verification sees what will be stored.
    x_new = x_new.to(c.dtype).float()
    new_row = _put(new_row.to(c.dtype).float(), j, x_new)
    ok = _verified(new_row, row_ref, row_tol, j, slack)
    if has_cols:
        new_col = _put(new_col.to(c.dtype).float(), i, x_new)
        col_ref, col_tol = _gather_col(sums.cols, j), _gather_col(sums.col_tol, j)
        ok &= _verified(new_col, col_ref, col_tol, i, slack)

    detected = (n_row > 0) | (n_col > 0)
    corrected = detected & fixable & ref_ok & ok
    keep = corrected[..., None]
    c.scatter_(
        -2,
        i[..., None, None].expand(*batch, 1, N),
        torch.where(keep, new_row, row).to(c.dtype)[..., None, :],
    )
    if has_cols:
        c.scatter_(
            -1,
            j[..., None, None].expand(*batch, M, 1),
            torch.where(keep, new_col, col).to(c.dtype)[..., None],
        )

    pattern = torch.full(batch, Pattern.NONE, dtype=torch.int8, device=c.device)
    many_r, many_c = n_row >= 2, n_col >= 2
    pattern = torch.where(detected, Pattern.D0, pattern)
    pattern = torch.where(many_c & (n_row <= 1), Pattern.R1, pattern)
    pattern = torch.where(many_r & (n_col <= 1), Pattern.C1 if has_cols else Pattern.MULTI, pattern)
    pattern = torch.where(many_r & many_c, Pattern.D2, pattern)
    pattern = torch.where(detected & ~ref_ok, Pattern.OPERAND, pattern).to(torch.int8)
    kind = torch.where(detected, _classify(x_old), ValueKind.NONE).to(torch.int8)
    return Report(detected, corrected, pattern, kind, i, j, bad_row, bad_col if has_cols else None)
