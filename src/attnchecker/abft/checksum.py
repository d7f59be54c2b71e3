"""Reference checksums of C = A @ B from the operands, and checksums recomputed from C.

Naming: a *row checksum* summarises one row of C (a sum over its columns), a *column checksum*
one column (a sum over its rows). Each comes in two flavours stacked in dimension -2: plain
(weights 1) and weighted (weights 1, 2, ..., n), which together locate a single bad element in
a vector (its index is d_weighted / d_plain - 1). Both are stored vector index last:
row checksums (..., 2, M), column checksums (..., 2, N).

Everything is accumulated in fp32 whatever the GEMM dtype. References are computed from A and B
only, never from C, so they predate any fault that lands in C.

Every product here is written "small on the left": (..., 2, n) @ (..., n, m). On CPU this is
several times faster than the same product with the thin operand on the right, whatever the
layout of the big operand (measured: 0.16 ms against 1.27 ms for A @ u with A (96, 128, 128)
and u (96, 128, 2)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnchecker.abft.tolerance import magnitude_factor, underflow_floor

__all__ = ["Checksums", "encode", "recompute", "weights"]

ROWS, COLS, BOTH = "rows", "cols", "both"
DIRECTIONS = (ROWS, COLS, BOTH)


def weights(n: int, device: torch.device) -> Tensor:
    """(2, n) fp32: the plain vector e = 1 and the weighted vector w = (1, ..., n), stacked.

    Built per call (a few microseconds): a cache would outlive tracing modes such as fake tensors.
    """
    w = torch.arange(1, n + 1, dtype=torch.float32, device=device)
    return torch.stack([torch.ones_like(w), w])  # (2, n)


class Checksums(NamedTuple):
    """Reference checksums of one (batched) product and their tolerances, all fp32.

    ``rows``/``row_tol`` are (..., 2, M) or None; ``cols``/``col_tol`` are (..., 2, N) or None.
    Index 0 of dimension -2 is the plain sum, index 1 the weighted one.
    """

    rows: Tensor | None
    cols: Tensor | None
    row_tol: Tensor | None
    col_tol: Tensor | None

    def transposed(self) -> Checksums:
        """The checksums of C^T: rows and columns swap roles."""
        return Checksums(self.cols, self.rows, self.col_tol, self.row_tol)


def encode(
    a: Tensor,
    b: Tensor,
    *,
    check: str = BOTH,
    a_abs: Tensor | None = None,
    b_abs: Tensor | None = None,
) -> Checksums:
    """Reference checksums of ``a @ b`` (any broadcastable leading batch dims) from the operands.

    a: (..., M, K), b: (..., K, N). The tolerance of each checksum bounds its rounding error
    (see :mod:`attnchecker.abft.tolerance`), computed from |a| and |b| in the same way. Pass
    ``a_abs`` / ``b_abs`` when they are known (``a`` itself for probabilities, a cached |W|)
    to save a pass over the operand.
    """
    if check not in DIRECTIONS:
        raise ValueError(f"check must be one of {DIRECTIONS}, got {check!r}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    a32, b32 = a.float(), b.float()
    a_abs = a32.abs() if a_abs is None else a_abs.float()
    b_abs = b32.abs() if b_abs is None else b_abs.float()
    rows = cols = row_tol = col_tol = None
    if check in (ROWS, BOTH):
        e = weights(N, a.device)
        # row sums of C = A (B e): (2, N) @ (.., N, K) -> (.., 2, K) @ (.., K, M) -> (.., 2, M)
        rows = (e @ b32.mT) @ a32.mT
        mag = (e @ b_abs.mT) @ a_abs.mT  # (..., 2, M)
        f = magnitude_factor(out_dtype, a.device, inner=K, length=N)
        row_tol = mag * f + underflow_floor(out_dtype, length=N, inner=K) * N  # weights <= N
    if check in (COLS, BOTH):
        e = weights(M, a.device)
        # column sums of C = (e A) B: (2, M) @ (.., M, K) -> (.., 2, K) @ (.., K, N) -> (.., 2, N)
        cols = (e @ a32) @ b32
        mag = (e @ a_abs) @ b_abs  # (..., 2, N)
        f = magnitude_factor(out_dtype, a.device, inner=K, length=M)
        col_tol = mag * f + underflow_floor(out_dtype, length=M, inner=K) * M
    return Checksums(rows, cols, row_tol, col_tol)


def recompute(c: Tensor, *, check: str = BOTH) -> tuple[Tensor | None, Tensor | None]:
    """Row checksums (..., 2, M) and column checksums (..., 2, N) of the delivered C, in fp32.

    Thin matmuls: on CPU they beat einsum and elementwise reductions, and an INF or NaN anywhere
    in a vector propagates into its sums, so no separate isfinite() scan is needed.
    """
    M, N = c.shape[-2], c.shape[-1]
    c32 = c.float()
    rows = weights(N, c.device) @ c32.mT if check in (ROWS, BOTH) else None  # (..., 2, M)
    cols = weights(M, c.device) @ c32 if check in (COLS, BOTH) else None  # (..., 2, N)
    return rows, cols
