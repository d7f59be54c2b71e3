"""Operand generators shared by the math-core tests."""

from __future__ import annotations

import torch
from torch import Tensor

from attnchecker.abft.testing import DATA, random_operands

__all__ = ["DATA", "DTYPES", "operands"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    return random_operands(
        (*batch, m, k),
        (*batch, k, n),
        dtype=dtype,
        scale=scale,
        data=data,
        generator=torch.Generator().manual_seed(seed),
    )
