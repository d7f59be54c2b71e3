"""Bit-level edits of floating-point tensors (pure functions, no state).

The reference fault of the published ATTNChecker study flips one exponent bit of an fp32 GEMM
output: bit 30 (the top exponent bit) if |x| < 2, else bit 29. For |x| < 1 this multiplies x by
2^128 (near-INF), for 1 <= |x| < 2 it gives INF or NaN, for |x| >= 2 it multiplies by 2^64. The
same rule carries over to bf16 (8 exponent bits: bits 14 / 13) and fp16 (5 exponent bits:
bits 14 / 13, factors 2^16 and 2^8).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["exponent_flip", "exponent_flip_bit", "flip_bit"]

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_TOP_EXPONENT_BIT = {torch.float32: 30, torch.bfloat16: 14, torch.float16: 14}


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _INT_VIEW:
        raise ValueError(f"bit flips support float32, bfloat16 and float16, not {dtype}")
    return _INT_VIEW[dtype]


def flip_bit(x: Tensor, bit: int | Tensor) -> Tensor:
    """A copy of ``x`` with ``bit`` (0 = least significant; a tensor broadcasts) flipped."""
    idt = _int_dtype(x.dtype)
    width = torch.iinfo(idt).bits
    if isinstance(bit, int) and not 0 <= bit < width:
        raise ValueError(f"bit must be in [0, {width}) for {x.dtype}, got {bit}")
    one = torch.ones((), dtype=idt, device=x.device)
    mask = torch.bitwise_left_shift(one, torch.as_tensor(bit, dtype=idt, device=x.device))
    return torch.bitwise_xor(x.contiguous().view(idt), mask).view(x.dtype)


def exponent_flip_bit(x: Tensor) -> Tensor:
    """The reference rule's bit for each element: top exponent bit if |x| < 2, else the next."""
    _int_dtype(x.dtype)  # raises for unsupported dtypes
    top = _TOP_EXPONENT_BIT[x.dtype]
    return torch.where(x.abs() < 2, top, top - 1)


def exponent_flip(x: Tensor) -> Tensor:
    """A copy of ``x`` with the reference exponent bit of every element flipped."""
    return flip_bit(x, exponent_flip_bit(x))
