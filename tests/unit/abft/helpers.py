"""Operand generators shared by the math-core tests."""

from __future__ import annotations

import torch
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DATA = ("normal", "positive", "constant", "lognormal", "zero_rows")


def operands(
    batch: tuple[int, ...],
    m: int,
    k: int,
    n: int,
    *,
    dtype: torch.dtype,
    scale: float,
    data: str,
    seed: int,
) -> tuple[Tensor, Tensor]:
    """a (*batch, m, k), b (*batch, k, n) in ``dtype``; max abs(a @ b) is ``scale``."""
    g = torch.Generator().manual_seed(seed)

    def draw(shape: tuple[int, ...]) -> Tensor:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        if data == "positive":
            return x.abs()
        if data == "constant":
            return torch.full(shape, 0.7, dtype=torch.float64)
        if data == "lognormal":
            return (2 * x).exp() * torch.randn(shape, generator=g, dtype=torch.float64).sign()
        if data == "zero_rows":
            x[..., ::3, :] = 0
        return x

    a, b = draw((*batch, m, k)), draw((*batch, k, n))
    peak = (a @ b).abs().amax()
    s = (scale / peak).sqrt() if peak > 0 else 1.0
    return (a * s).to(dtype), (b * s).to(dtype)
