"""Fault kinds: pure edits of the elements of a tensor selected by an index (no state).

The reference fault of the published ATTNChecker study flips one exponent bit of an fp32 GEMM
output: bit 30 (the top exponent bit) if |x| < 2, else bit 29. For |x| < 1 this multiplies x by
2^128 (near-INF), for 1 <= |x| < 2 it gives INF or NaN, for |x| >= 2 it multiplies by 2^64. The
same rule carries over to bf16 (8 exponent bits: bits 14 / 13) and fp16 (5 exponent bits:
bits 14 / 13, factors 2^16 and 2^8).
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_KINDS",
    "KERNEL_MODES",
    "FaultKind",
    "apply_kind",
    "exponent_flip",
    "exponent_flip_bit",
    "flip_bit",
]

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


class FaultKind(enum.StrEnum):
    """What a fault does to each selected element."""

    BIT_FLIP = "bit_flip"  # flip bit ``bit``
    EXPONENT_FLIP = "exponent_flip"  # the reference rule above
    INF = "inf"
    NEG_INF = "-inf"
    NAN = "nan"
    NEAR_INF = "near_inf"  # set to ``value`` (1e10 by default; saturates to INF in fp16)
    SCALE = "scale"  # multiply by ``value``
    RANDOM = "random"  # a random finite value, log-uniform in magnitude in [1, ``value``]


DEFAULT_KINDS: tuple[str, ...] = tuple(
    k.value for k in (FaultKind.INF, FaultKind.NAN, FaultKind.NEAR_INF, FaultKind.EXPONENT_FLIP)
)
"""The kinds campaigns and sampled fault plans draw from unless told otherwise: the extreme
errors the checks target and the published study's exponent flip."""

# How each fault kind is expressed inside the fused kernels (``attnchecker.kernels.common``'s
# modes); a kind without an entry is refused by name, never approximated. RANDOM draws one value
# per fault: every element of a 1R / 1C line gets it (the eager sites draw one per element).
KERNEL_MODES = {
    FaultKind.EXPONENT_FLIP: "exponent",
    FaultKind.BIT_FLIP: "bit",  # of the fp32 value in the kernel's tile
    FaultKind.SCALE: "scale",
    FaultKind.RANDOM: "set",
    FaultKind.INF: "set",
    FaultKind.NEG_INF: "set",
    FaultKind.NAN: "set",
    FaultKind.NEAR_INF: "set",
}


def _edited(
    kind: FaultKind,
    old: Tensor,
    *,
    bit: int | None,
    value: float | None,
    generator: torch.Generator | None,
) -> Tensor:
    if kind is FaultKind.BIT_FLIP:
        if bit is None:
            raise ValueError("a bit_flip fault needs bit=")
        return flip_bit(old, bit)
    if kind is FaultKind.EXPONENT_FLIP:
        return exponent_flip(old)
    if kind is FaultKind.SCALE:
        return old * (2.0 if value is None else value)
    if kind is FaultKind.RANDOM:
        top = 1e8 if value is None else value
        u = torch.rand(old.shape, generator=generator, dtype=torch.float64)
        sign = torch.where(torch.rand(old.shape, generator=generator) < 0.5, -1.0, 1.0)
        return (sign * top**u).to(old.dtype).to(old.device)
    fill = {
        FaultKind.INF: float("inf"),
        FaultKind.NEG_INF: float("-inf"),
        FaultKind.NAN: float("nan"),
    }
    v = fill.get(kind, 1e10 if value is None else value)
    return torch.full(old.shape, v, dtype=torch.float32, device=old.device).to(old.dtype)


def apply_kind(
    kind: FaultKind | str,
    t: Tensor,
    index: tuple | Tensor,
    *,
    bit: int | None = None,
    value: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Edit ``t[index]`` in place as ``kind`` says; return (old values, new values)."""
    kind = FaultKind(kind)
    with torch.no_grad():
        old = t[index].clone()
        new = _edited(kind, old, bit=bit, value=value, generator=generator)
        t[index] = new
    return old, new
