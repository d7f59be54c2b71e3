"""Random GEMM operands of controlled shape, distribution and output scale, for the tests and
benchmarks of the math core (like ``torch.testing``: a helper, not part of the protection)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["DATA", "random_operands"]

DATA = ("normal", "positive", "constant", "lognormal", "zero_rows")


def random_operands(
    shape_a: tuple[int, ...],
    shape_b: tuple[int, ...],
    *,
    dtype: torch.dtype,
    scale: float,
    data: str,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """a (*batch, m, k), b (*batch, k, n) in ``dtype``, drawn in float64 as ``data`` says (one of
    :data:`DATA`) and scaled together so that max |a @ b| is ``scale``."""
    if data not in DATA:
        raise ValueError(f"data must be one of {DATA}, got {data!r}")

    def draw(shape: tuple[int, ...]) -> Tensor:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        if data == "positive":
            return x.abs()
        if data == "constant":
            return torch.full(shape, 0.7, dtype=torch.float64)
        if data == "lognormal":
            sign = torch.randn(shape, generator=generator, dtype=torch.float64).sign()
            return (2 * x).exp() * sign
        if data == "zero_rows":
            x[..., ::3, :] = 0
        return x

    a, b = draw(shape_a), draw(shape_b)
    peak = (a @ b).abs().amax()
    s = (scale / peak).sqrt() if peak > 0 else 1.0
    return (a * s).to(dtype), (b * s).to(dtype)
