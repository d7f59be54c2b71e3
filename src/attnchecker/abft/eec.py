"""Verify a product against its reference checksums, locate and correct errors (EEC).

Contract of :func:`correct_`: given the delivered C (..., M, N) and its reference
:class:`~attnchecker.abft.checksum.Checksums`, it

1. flags every row / column whose plain or weighted checksum differs from the reference by more
   than its tolerance (INF and NaN propagate into the sums, so they are always flagged);
2. locates the errors of each matrix of the batch. With both directions checked: one bad row
   and one bad column (0D), one bad row and several bad columns (1R), several bad rows and one
   bad column (1C); several of each (2D) cannot be located. With one direction: one bad vector,
   the error located inside it from the weighted sum (or as its non-finite / blown-up element);
3. corrects in place. With the operands at hand (the normal case: ``protected_matmul`` and the
   attention pipeline keep them), corrected values are recomputed from them: row i of A times B
   for a bad row, A times column j of B for a bad column. Column-wise reconstruction of a bad
   row would need the sums of every column without that row, a full pass over C; the rebuild
   costs one vector-matrix product and is exact. Without operands, a single element is
   reconstructed from its row's reference checksum and the other elements of the row (EEC; a
   masked sum that excludes it, so INF - INF never occurs);
4. re-verifies the corrected row and column (plain and weighted sums) and keeps a correction
   only if both agree with their references. A wrong location therefore never passes silently:
   the matrix is reported uncorrectable and left as delivered. A rebuilt value is exact up to
   rounding, so its check uses the plain tolerance, and any error left elsewhere in the vector
   must be below it. A reconstructed value is itself known only to within the row's tolerance,
   which the check must allow (the weighted sum sees it pos + 1 times), so without operands a
   second, smaller error in the same vector can be absorbed into the correction.

Everything is fixed-size tensor work per matrix (one candidate row and one candidate column are
gathered, fixed and scattered back): no ``.item()``, no branch on tensor values, no host
synchronisation. The :class:`Report` holds raw tensors; its derived fields (``detected``,
``pattern``, ``kind``) are computed when read, and :meth:`Report.summary` syncs.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import torch
from torch import Tensor

from attnchecker.abft.checksum import BOTH, ROWS, Checksums, recompute, weights

__all__ = ["NEAR_INF", "Pattern", "Report", "ValueKind", "classify", "correct_"]

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
    """Per-matrix results for a batch ``...`` of products: raw tensors on C's device.

    ``bad_rows``/``bad_cols`` (and the counts ``n_rows``/``n_cols``) are None for a direction
    that was not checked.
    """

    corrected: Tensor  # (...) bool: corrected and re-verified
    row: Tensor  # (...) int64: located row (meaningful when detected)
    col: Tensor  # (...) int64: located column
    value: Tensor  # (...) fp32: the delivered value at (row, col)
    operands_ok: Tensor  # (...) bool: the reference checksums are finite
    bad_rows: Tensor | None  # (..., M) bool
    bad_cols: Tensor | None  # (..., N) bool

    @property
    def n_rows(self) -> Tensor | None:
        return None if self.bad_rows is None else self.bad_rows.sum(-1)

    @property
    def n_cols(self) -> Tensor | None:
        return None if self.bad_cols is None else self.bad_cols.sum(-1)

    @property
    def detected(self) -> Tensor:
        flags = [x.any(-1) for x in (self.bad_rows, self.bad_cols) if x is not None]
        return flags[0] | flags[1] if len(flags) == 2 else flags[0]

    @property
    def uncorrectable(self) -> Tensor:
        return self.detected & ~self.corrected

    @property
    def pattern(self) -> Tensor:
        """(...) int8 :class:`Pattern` of each matrix."""
        nr, nc = self.n_rows, self.n_cols
        one_direction = nr is None or nc is None
        n = nr if nc is None else nc if nr is None else None
        p = torch.full_like(self.corrected, Pattern.NONE, dtype=torch.int8)
        if one_direction:
            p = torch.where(n >= 1, Pattern.D0, p)
            p = torch.where(n >= 2, Pattern.MULTI, p)
        else:
            p = torch.where((nr >= 1) | (nc >= 1), Pattern.D0, p)
            p = torch.where((nr <= 1) & (nc >= 2), Pattern.R1, p)
            p = torch.where((nr >= 2) & (nc <= 1), Pattern.C1, p)
            p = torch.where((nr >= 2) & (nc >= 2), Pattern.D2, p)
        p = torch.where(self.detected & ~self.operands_ok, Pattern.OPERAND, p)
        return p.to(torch.int8)

    @property
    def kind(self) -> Tensor:
        """(...) int8 :class:`ValueKind` of the delivered value at the located position."""
        return torch.where(self.detected, classify(self.value), ValueKind.NONE).to(torch.int8)

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

    def transposed(self) -> Report:
        """The report of C seen as the report of C^T, or back."""
        return self._replace(
            row=self.col, col=self.row, bad_rows=self.bad_cols, bad_cols=self.bad_rows
        )


def classify(x: Tensor) -> Tensor:
    """The :class:`ValueKind` of every element of x, as int8 (FINITE for ordinary values)."""
    k = torch.where(x.abs() >= NEAR_INF, ValueKind.NEAR_INF, ValueKind.FINITE)
    k = torch.where(x == float("inf"), ValueKind.POS_INF, k)
    k = torch.where(x == float("-inf"), ValueKind.NEG_INF, k)
    return torch.where(x.isnan(), ValueKind.NAN, k).to(torch.int8)


def _first(mask: Tensor) -> Tensor:
    """Index of the first True along the last dim (0 when there is none)."""
    return mask.to(torch.uint8).argmax(-1)


def _bad(ref: Tensor, got: Tensor, tol: Tensor) -> tuple[Tensor, Tensor]:
    """Flags (Bt, n) of vectors whose sums (Bt, 2, n) differ beyond tol, and the differences."""
    d = ref - got
    return ~(d.abs() <= tol).all(-2), d  # NaN compares False: flagged


def _locate(vec: Tensor, d: Tensor, tol: Tensor) -> tuple[Tensor, Tensor]:
    """Where is the single bad element of each vector (Bt, n)? Returns (index, reliable), (Bt,).

    d (Bt, 2) and tol (Bt, 2) are the vector's plain and weighted checksum differences and
    tolerances. A non-finite element is its own location. Otherwise d_w / d_1 = loc + 1 up to
    (tol_w + n tol_1) / |d_1|, so the ratio is trusted only when |d_1| > 2 (tol_w + n tol_1);
    if the weighted difference overflowed, the element of largest magnitude is the blown-up one.
    """
    n = vec.shape[-1]
    finite = vec.isfinite()
    all_finite = finite.all(-1)
    loudest = torch.where(finite, vec.abs(), float("inf")).argmax(-1)
    loc = (d[:, 1] / d[:, 0]).round() - 1
    sharp = d[:, 0].abs() > 2 * (tol[:, 1] + n * tol[:, 0])
    use_ratio = all_finite & sharp & (loc >= 0) & (loc <= n - 1)  # False for NaN/INF ratios
    overflowed = d[:, 0].isfinite() & ~d[:, 1].isfinite()
    loc = loc.nan_to_num(0.0, 0.0, 0.0).clamp(0, n - 1).long()
    reliable = ~all_finite | use_ratio | overflowed
    return torch.where(use_ratio, loc, loudest), reliable


def _verified(vec: Tensor, ref: Tensor, tol: Tensor, pos: Tensor, slack: Tensor | float) -> Tensor:
    """Does the corrected vec (Bt, n) match its reference sums ref (Bt, 2) within tol (Bt, 2)?

    The element at ``pos`` (Bt,) was replaced by a value known to within ``slack`` (Bt,), which
    the plain sum sees once and the weighted sum (pos + 1) times.
    """
    sums = vec @ weights(vec.shape[-1], vec.device).T  # (Bt, n) @ (n, 2) -> (Bt, 2)
    slack = torch.as_tensor(slack, device=vec.device)
    extra = torch.stack(torch.broadcast_tensors(slack, slack * (pos + 1)), -1)  # (Bt, 2)
    return ((ref - sums).abs() <= tol + extra).all(-1)


class _Operands(NamedTuple):
    """Row i of A and column j of B for every matrix of the batch, and what they rebuild."""

    a: Tensor  # (..., M, K) broadcast to the batch
    b: Tensor  # (..., K, N)
    a_i: Tensor  # (..., 1, K)
    b_j: Tensor  # (..., K, 1)

    @classmethod
    def gather(cls, a: Tensor, b: Tensor, batch: torch.Size, i: Tensor, j: Tensor) -> _Operands:
        M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
        a, b = a.expand(*batch, M, K), b.expand(*batch, K, N)
        a_i = a.gather(-2, i.view(*batch, 1, 1).expand(*batch, 1, K))
        b_j = b.gather(-1, j.view(*batch, 1, 1).expand(*batch, K, 1))
        return cls(a, b, a_i, b_j)

    def element(self) -> Tensor:
        """C[i, j] = A[i] . B[:, j]: (Bt,), O(K) per matrix."""
        return (self.a_i.float().squeeze(-2) * self.b_j.float().squeeze(-1)).sum(-1).reshape(-1)

    def row(self) -> Tensor:
        """C[i, :] = A[i] B: (Bt, N); reads all of B. Small-left: (..., 1, K) @ (..., K, N)."""
        return (self.a_i @ self.b).reshape(-1, self.b.shape[-1]).float()

    def col(self) -> Tensor:
        """C[:, j] = A B[:, j]: (Bt, M); reads all of A. As (..., 1, K) @ (..., K, M)."""
        return (self.b_j.mT @ self.a.mT).reshape(-1, self.a.shape[-2]).float()


def _flat(c: Tensor) -> Tensor:
    """(Bt, M, N) view of c (..., M, N), so in-place writes reach c."""
    return c.view(-1, *c.shape[-2:])


@torch.no_grad()
def correct_(
    c: Tensor,
    sums: Checksums,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    lines: bool = True,
) -> Report:
    """Verify C = a @ b against ``sums`` and correct it in place; see the module docstring.

    c: (..., M, N). ``a`` (..., M, K) and ``b`` (..., K, N) are optional: with them, corrected
    values are recomputed from the operands; without them, single elements are reconstructed
    from their row checksum. ``lines`` (with operands and both directions checked) also corrects
    a whole bad row or column (1R, 1C) by rebuilding it, at the price of reading one operand
    whole on every call: one row needs all of B, one column all of A. With ``lines=False`` the
    always-on work is O(M + N + K) per matrix and 1R / 1C are reported uncorrectable.
    """
    if sums.rows is None and sums.cols is None:
        raise ValueError("sums holds neither row nor column checksums")
    have_ops = a is not None and b is not None
    if sums.rows is None:  # columns only: work on C^T = b^T a^T, whose rows are C's columns
        ops = (b.mT, a.mT) if have_ops else (None, None)
        return correct_(c.mT, sums.transposed(), *ops, lines=lines).transposed()
    both = sums.cols is not None
    batch, (M, N) = c.shape[:-2], c.shape[-2:]
    cv = _flat(c)  # (Bt, M, N)
    ar = torch.arange(cv.shape[0], device=c.device)
    rows, cols = recompute(cv, check=BOTH if both else ROWS)
    ref_r, tol_r = sums.rows.reshape(-1, 2, M), sums.row_tol.reshape(-1, 2, M)
    bad_r, d_r = _bad(ref_r, rows, tol_r)  # (Bt, M)
    n_r = bad_r.sum(-1)
    ops_ok = ref_r.isfinite().flatten(1).all(-1)  # (Bt,)
    i = _first(bad_r)
    row = cv[ar, i].float()  # (Bt, N)
    ref_i, tol_i = ref_r[ar, :, i], tol_r[ar, :, i]  # (Bt, 2)
    if both:
        ref_c, tol_c = sums.cols.reshape(-1, 2, N), sums.col_tol.reshape(-1, 2, N)
        bad_c, _ = _bad(ref_c, cols, tol_c)  # (Bt, N)
        n_c = bad_c.sum(-1)
        ops_ok &= ref_c.isfinite().flatten(1).all(-1)
        j = _first(bad_c)
        col = cv[ar, :, j].float()  # (Bt, M)
        fixable = (n_r == 1) & (n_c == 1)  # 0D: located by intersection
    else:
        bad_c = None
        j, fixable = _locate(row, d_r[ar, :, i], tol_i)
        fixable &= n_r == 1
    x_old = row[ar, j]
    new_row = row
    new_col = col if both else None
    if have_ops:
        ops = _Operands.gather(a, b, batch, i, j)
        x_new = ops.element()
        slack: Tensor | float = 0.0
        if both and lines:
            row_ab, col_ab = ops.row(), ops.col()
            is_1r, is_1c = (n_r == 1) & (n_c >= 2), (n_r >= 2) & (n_c == 1)
            new_row = torch.where(is_1r[:, None], row_ab, row)
            new_col = torch.where(is_1c[:, None], col_ab, col)
            x_new = torch.where(is_1r, row_ab[ar, j], torch.where(is_1c, col_ab[ar, i], x_new))
            fixable |= is_1r | is_1c
    else:
        # EEC: the element from its row's reference and the other elements of the row.
        others = torch.where(torch.arange(N, device=c.device) == j[:, None], 0.0, row).sum(-1)
        x_new = ref_i[:, 0] - others
        slack = tol_i[:, 0]
    # Round to C's dtype first, so that verification sees what will be stored.
    x_new = x_new.to(c.dtype).float()
    new_row = new_row.to(c.dtype).float().index_put((ar, j), x_new)
    ok = fixable & ops_ok & _verified(new_row, ref_i, tol_i, j, slack)
    if both:
        new_col = new_col.to(c.dtype).float().index_put((ar, i), x_new)
        ok &= _verified(new_col, ref_c[ar, :, j], tol_c[ar, :, j], i, slack)
    keep = ok[:, None]
    cv[ar, i] = torch.where(keep, new_row, row).to(c.dtype)
    if both:
        cv[ar, :, j] = torch.where(keep, new_col, col).to(c.dtype)

    def shaped(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape((*batch, *x.shape[1:]))

    return Report(
        corrected=shaped(ok),
        row=shaped(i),
        col=shaped(j),
        value=shaped(x_old),
        operands_ok=shaped(ops_ok),
        bad_rows=shaped(bad_r),
        bad_cols=shaped(bad_c),
    )
