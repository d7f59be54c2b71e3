"""Fault kinds, defined once: what each kind does to an element, on the eager sites and inside
the fused kernels alike.

Every kind is a *mode* applied with a *value* (:data:`KINDS`): ``set`` the element to the value,
``scale`` it by the value, flip ``bit``, or flip the reference ``exponent`` bit. The eager sites
(:mod:`attnchecker.inject`) edit tensors with :func:`edit` / :func:`apply_kind`; the fused kernels
(:mod:`attnchecker.kernels.common`) receive the mode's code (:data:`MODES`) and the value from
:func:`kernel_edit`, and read the exponent rule's constants from here. The one difference is
where a drawn value is drawn: RANDOM draws one value per element on the eager sites, one per
fault in the kernels (every element of a 1R / 1C line gets it). A new kind is a member of
:class:`FaultKind` and an entry of :data:`KINDS`, in this file only.

The reference fault of the published ATTNChecker study flips one exponent bit of an fp32 GEMM
output: bit 30 (the top exponent bit) if |x| < 2, else bit 29. For |x| < 1 this multiplies x by
2^128 (near-INF), for 1 <= |x| < 2 it gives INF or NaN, for |x| >= 2 it multiplies by 2^64. The
same rule carries over to bf16 (8 exponent bits: bits 14 / 13) and fp16 (5 exponent bits:
bits 14 / 13, factors 2^16 and 2^8).

This module imports torch (and the near-INF threshold of :mod:`attnchecker.abft`) only, so the
kernels, which sit below :mod:`attnchecker.inject`, read the same table.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnchecker.abft.eec import NEAR_INF
from attnchecker.errors import ConfigError

__all__ = [
    "EXPONENT_LIMIT",
    "KERNEL_MODES",
    "KINDS",
    "MODES",
    "TOP_EXPONENT_BIT",
    "FaultKind",
    "Kind",
    "apply_kind",
    "edit",
    "exponent_flip",
    "exponent_flip_bit",
    "flip_bit",
    "kernel_edit",
    "kind_of",
]

MODES = {"set": 0, "scale": 1, "bit": 2, "exponent": 3}
"""Each mode's code in the fused kernels' fault vector (:mod:`attnchecker.kernels.common`)."""

TOP_EXPONENT_BIT = {torch.float32: 30, torch.bfloat16: 14, torch.float16: 14}
"""The top exponent bit of each floating dtype a fault can flip bits of."""

EXPONENT_LIMIT = 2.0
"""The reference rule: flip the top exponent bit where |x| < EXPONENT_LIMIT, else the next one
down (so that |x| >= 2 grows by 2^64 in fp32 instead of becoming INF / NaN)."""

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _INT_VIEW:
        raise ConfigError(f"bit flips support float32, bfloat16 and float16, not {dtype}")
    return _INT_VIEW[dtype]


def flip_bit(x: Tensor, bit: int | Tensor) -> Tensor:
    """A copy of ``x`` with ``bit`` (0 = least significant; a tensor broadcasts) flipped."""
    idt = _int_dtype(x.dtype)
    width = torch.iinfo(idt).bits
    if isinstance(bit, int) and not 0 <= bit < width:
        raise ConfigError(f"bit must be in [0, {width}) for {x.dtype}, got {bit}")
    one = torch.ones((), dtype=idt, device=x.device)
    mask = torch.bitwise_left_shift(one, torch.as_tensor(bit, dtype=idt, device=x.device))
    return torch.bitwise_xor(x.contiguous().view(idt), mask).view(x.dtype)


def exponent_flip_bit(x: Tensor) -> Tensor:
    """The reference rule's bit for each element: top exponent bit if |x| < 2, else the next."""
    _int_dtype(x.dtype)  # raises for unsupported dtypes
    top = TOP_EXPONENT_BIT[x.dtype]
    return torch.where(x.abs() < EXPONENT_LIMIT, top, top - 1)


def exponent_flip(x: Tensor) -> Tensor:
    """A copy of ``x`` with the reference exponent bit of every element flipped."""
    return flip_bit(x, exponent_flip_bit(x))


class FaultKind(enum.StrEnum):
    """What a fault does to each selected element (its mode and value: :data:`KINDS`)."""

    BIT_FLIP = "bit_flip"  # flip bit ``bit``
    EXPONENT_FLIP = "exponent_flip"  # the reference rule above
    INF = "inf"
    NEG_INF = "-inf"
    NAN = "nan"
    NEAR_INF = "near_inf"  # set to ``value`` (1e10 by default; saturates to INF in fp16)
    SCALE = "scale"  # multiply by ``value``
    RANDOM = "random"  # a random finite value, log-uniform in magnitude in [1, ``value``]


@dataclass(frozen=True)
class Kind:
    """How a fault kind edits an element: ``mode`` (:data:`MODES`) applied with a value, which
    is ``value`` whatever the fault says (``fixed``), else the fault's own value or ``value``
    when it gives none; ``drawn``: a random value of that magnitude instead (log-uniform in
    [1, value], either sign). ``kernel``: the fused kernels express it (a kind they do not is
    refused by name at kernel sites, never approximated)."""

    mode: str
    value: float | None = None
    fixed: bool = False
    drawn: bool = False
    kernel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")

    def parameter(
        self,
        given: float | None,
        generator: torch.Generator | None,
        shape: torch.Size | None = None,
    ) -> float | Tensor:
        """The value the mode applies: a float, or for a ``drawn`` kind with a ``shape``, one
        draw per element (a float64 tensor of that shape; without a shape, one draw)."""
        top = self.value if self.fixed or given is None else given
        if not self.drawn:
            return top
        if shape is None:
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            sign = -1.0 if float(torch.rand((), generator=generator)) < 0.5 else 1.0
            return sign * top**u
        u = torch.rand(shape, generator=generator, dtype=torch.float64)
        sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
        return sign * top**u


KINDS: dict[FaultKind, Kind] = {
    FaultKind.BIT_FLIP: Kind("bit"),  # in the kernels, of the fp32 value in the tile
    FaultKind.EXPONENT_FLIP: Kind("exponent"),
    FaultKind.INF: Kind("set", math.inf, fixed=True),
    FaultKind.NEG_INF: Kind("set", -math.inf, fixed=True),
    FaultKind.NAN: Kind("set", math.nan, fixed=True),
    FaultKind.NEAR_INF: Kind("set", NEAR_INF),  # the least value the checks call near-INF
    FaultKind.SCALE: Kind("scale", 2.0),
    FaultKind.RANDOM: Kind("set", 1e8, drawn=True),
}
"""Every fault kind's edit, for the eager sites and the kernels."""

KERNEL_MODES: dict[FaultKind, str] = {k: s.mode for k, s in KINDS.items() if s.kernel}
"""The kinds the fused kernels express, and their modes."""


def edit(
    kind: FaultKind | str,
    old: Tensor,
    *,
    bit: int | None = None,
    value: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``old`` as a fault of ``kind`` leaves it (a new tensor; a drawn value per element)."""
    kind = FaultKind(kind)
    spec = KINDS[kind]
    if spec.mode == "bit":
        if bit is None:
            raise ConfigError(f"a {kind} fault needs bit=")
        return flip_bit(old, bit)
    if spec.mode == "exponent":
        return exponent_flip(old)
    v = spec.parameter(value, generator, old.shape)
    if spec.mode == "scale":
        return old * v
    if isinstance(v, Tensor):  # drawn per element, in float64
        return v.to(old.dtype).to(old.device)
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
    with torch.no_grad():
        old = t[index].clone()
        new = edit(kind, old, bit=bit, value=value, generator=generator)
        t[index] = new
    return old, new


def kernel_edit(
    kind: FaultKind | str, *, value: float | None, generator: torch.Generator | None
) -> tuple[str, float]:
    """(mode, value) of a fault of ``kind`` as the fused kernels take it (one drawn value per
    fault); raises :class:`~attnchecker.errors.ConfigError` for a kind they do not express."""
    kind = FaultKind(kind)
    spec = KINDS[kind]
    if not spec.kernel:
        raise ConfigError(
            f"the kernels cannot express fault kind {kind!s}; they take "
            f"{sorted(str(k) for k in KERNEL_MODES)}"
        )
    if spec.mode in ("bit", "exponent"):
        return spec.mode, 0.0
    return spec.mode, float(spec.parameter(value, generator))


def kind_of(value: float) -> str:
    """What a delivered value looked like: inf, -inf, nan, near_inf (|x| >= 1e10) or finite
    (the spelling of ``attnchecker.inject.kinds.FaultKind``)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return "near_inf" if abs(value) >= NEAR_INF else "finite"
