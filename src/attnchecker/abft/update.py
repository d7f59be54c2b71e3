"""Row checksums of an optimizer update. Pure tensor math.

Every update the package checks is, row by row, linear in row sums it can keep: AdamW's moments
``m' = b1 m + (1 - b1) g`` and ``v' = b2 v + (1 - b2) g^2``, and its parameters ``p' = (1 - lr
wd) p - (lr / bc1) r`` with ``r = m' / (sqrt(v') / sqrt(bc2) + eps)``, computed from the new
state; SGD's ``buf' = mu buf + (1 - damp) (g + wd p)``, ``p' = p - lr buf'``. A tensor is viewed
as rows (its last dim; a 1-D tensor: rows of up to 4,096), and each row keeps three float64 sums
of each quantity: ``[sum x_j, sum (j + 1) x_j, sum |x_j|]``. The plain sum detects, the weighted
one locates a single element (``(j + 1) = dW / d1``), the absolute one bounds rounding.

Tolerance (per row, for ``q' = sum_k a_k X_k``): every element of ``q'`` is a few fp operations
on its inputs, each rounding by at most ``u`` (the tensor's unit roundoff) of what it produces,
so ``|sum q' - sum_k a_k sum X_k| <= c u (sum |q'| + sum_k |a_k| sum |X_k|)``, with ``c = 4``
covering a lerp's or an addcdiv's three roundings (and a fused kernel's FMAs, which round less).
The sums themselves are float64 over the tensor's exact values: their own error, ``~ C 2^-53``
of the row's magnitude, is far inside ``u``. A single element off by ``delta`` is seen once
``|delta| > c u`` times the row's L1 norm: for a 4,096-wide fp32 row, from ~1e-3 of the row's
mean magnitude.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["C", "as_rows", "excess", "locate", "row_sums", "unit"]

C = 4.0  # roundings per element (see the module docstring)


def as_rows(t: Tensor) -> Tensor:
    """``t`` as (rows, width): its last dim; a 0-/1-D tensor in rows of up to 4,096 where its
    size divides (a kernel's program takes a few rows: one row of a large flat tensor would be
    one program streaming all of it), else one row."""
    if t.dim() >= 2:
        return t.reshape(-1, t.shape[-1])
    n = t.numel()
    width = next((w for w in (4096, 2048, 1024, 512) if n > w and n % w == 0), max(n, 1))
    return t.reshape(-1, width)


def row_sums(t: Tensor) -> Tensor:
    """``(rows, 3)`` float64: ``[sum x, sum (j + 1) x, sum |x|]`` per row of :func:`as_rows`."""
    x = as_rows(t.detach()).double()  # (R, C)
    w = torch.arange(1, x.shape[1] + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(1), x @ w, x.abs().sum(1)], dim=1)


def unit(dtype: torch.dtype) -> float:
    """The unit roundoff of ``dtype``."""
    return torch.finfo(dtype).eps / 2


def excess(
    got: Tensor, terms: list[tuple[Tensor | float, Tensor]], u: float, scale: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(delta, over)`` per row: ``delta`` (rows, 2) the delivered minus the predicted plain and
    weighted sums (``terms``: ``(a_k, sums of X_k)``); ``over`` (rows,) how far ``|delta|``
    exceeds the tolerance (> 0: flagged; +inf when not finite)."""
    pred = sum(a * s[:, :2] for a, s in terms)
    mag = got[:, 2] + sum(abs(a) * s[:, 2] if isinstance(a, float) else a.abs() * s[:, 2]
                          for a, s in terms)  # fmt: skip
    delta = got[:, :2] - pred
    over = (delta[:, 0].abs() - scale * C * u * mag).nan_to_num(float("inf"), float("inf"))
    return delta, torch.where(torch.isfinite(mag), over, torch.full_like(over, float("inf")))


def locate(delta: Tensor, width: int) -> int | None:
    """The column of a single wrong element in a row from its ``delta`` (plain, weighted), or
    None when it is not one element (the ratio is not a column index)."""
    d1, dw = float(delta[0]), float(delta[1])
    if d1 == 0 or not (abs(d1) < float("inf") and abs(dw) < float("inf")):
        return None
    j = dw / d1
    if not abs(j) < float("inf"):
        return None
    col = round(j)
    return col - 1 if 1 <= col <= width and abs(j - col) < 0.1 else None
