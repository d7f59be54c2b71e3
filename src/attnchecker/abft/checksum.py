"""Reference checksums of C = A @ B from the operands, and checksums recomputed from C.

Naming: a *row checksum* summarises one row of C (a sum over its columns), a *column checksum*
one column (a sum over its rows). Each comes in two flavours stacked in the last-but-one or last
dimension: plain (weights 1) and weighted (weights 1, 2, ..., n), which together locate a single
bad element in a vector (its index is d_weighted / d_plain - 1).

Everything is accumulated in fp32 whatever the GEMM dtype. References are computed from A and B
only, never from C, so they predate any fault that lands in C.
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

    ``rows``/``row_tol`` are (..., M, 2) or None; ``cols``/``col_tol`` are (..., 2, N) or None.
    Index 0 of the size-2 dimension is the plain sum, index 1 the weighted one.
    """

    rows: Tensor | None
    cols: Tensor | None
    row_tol: Tensor | None
    col_tol: Tensor | None


def encode(a: Tensor, b: Tensor, *, check: str = BOTH) -> Checksums:
    """Reference checksums of ``a @ b`` (any broadcastable leading batch dims) from the operands.

    a: (..., M, K), b: (..., K, N). The tolerance of each checksum bounds its rounding error
    (see :mod:`attnchecker.abft.tolerance`), computed from |a| and |b| in the same way.
    """
    if check not in DIRECTIONS:
        raise ValueError(f"check must be one of {DIRECTIONS}, got {check!r}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    a32, b32 = a.float(), b.float()
    a_abs, b_abs = a32.abs(), b32.abs()
    rows = cols = row_tol = col_tol = None
    if check in (ROWS, BOTH):
        en = weights(N, a.device).T  # (N, 2)
        rows = a32 @ (b32 @ en)  # (..., M, K) @ (..., K, 2) -> (..., M, 2)
        mag = a_abs @ (b_abs @ en)  # (..., M, 2)
        f = magnitude_factor(out_dtype, a.device, inner=K, length=N)
        row_tol = mag * f + underflow_floor(out_dtype, length=N) * N  # weights <= N
    if check in (COLS, BOTH):
        em = weights(M, a.device)  # (2, M)
        cols = (em @ a32) @ b32  # (2, M) @ (..., M, K) -> (..., 2, K) @ (..., K, N) -> (..., 2, N)
        mag = (em @ a_abs) @ b_abs  # (..., 2, N)
        f = magnitude_factor(out_dtype, a.device, inner=K, length=M)
        col_tol = mag * f + underflow_floor(out_dtype, length=M) * M
    return Checksums(rows, cols, row_tol, col_tol)


def recompute(c: Tensor, *, check: str = BOTH) -> tuple[Tensor | None, Tensor | None]:
    """Row checksums (..., M, 2) and column checksums (..., 2, N) of the delivered C, in fp32.

    Written as two thin matmuls: on CPU they beat einsum and elementwise reductions, and an INF
    or NaN anywhere in a vector propagates into its sums, so no separate isfinite() scan is needed.
    """
    M, N = c.shape[-2], c.shape[-1]
    c32 = c.float()
    rows = c32 @ weights(N, c.device).T if check in (ROWS, BOTH) else None  # (..., M, 2)
    cols = weights(M, c.device) @ c32 if check in (COLS, BOTH) else None  # (..., 2, N)
    return rows, cols
