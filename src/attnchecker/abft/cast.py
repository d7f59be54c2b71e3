"""The operands a lower-precision op really multiplies under autocast, defined once.

A check must see what the GEMM (or SDPA) multiplied, not what the model handed it: under
``torch.autocast`` a lower-precision op casts its floating-point inputs, other than fp64, to the
autocast dtype. The autograd functions save those casts, the SDPA route and the fused kernels
take them, the checks' references are computed from them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocast_dtype", "autocast_operands", "round_as"]

_DROP = {torch.bfloat16: 16, torch.float16: 13}  # fp32 mantissa bits each dtype drops


def autocast_dtype(t: Tensor) -> torch.dtype:
    """The dtype autocast casts ``t`` to for a lower-precision op (its own where it casts
    nothing), without casting it."""
    dev = t.device.type
    if not torch.is_autocast_enabled(dev) or not t.is_floating_point() or t.dtype == torch.float64:
        return t.dtype
    return torch.get_autocast_dtype(dev)


def autocast_operands(*ts: Tensor | None) -> tuple[Tensor | None, ...]:
    """``ts`` as autocast casts them for a lower-precision op on their device (floating-point
    tensors, fp64 aside, to the autocast dtype); the same tensors without autocast. None
    passes through (an absent bias)."""
    dev = next(t for t in ts if t is not None).device.type
    if not torch.is_autocast_enabled(dev):
        return ts
    low = torch.get_autocast_dtype(dev)
    return tuple(
        t.to(low)
        if t is not None and t.is_floating_point() and t.dtype not in (low, torch.float64)
        else t
        for t in ts
    )


def round_as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t's values rounded to ``dtype`` (bf16 / fp16) as ``t.to(dtype)`` rounds them (to nearest,
    ties to even), as an fp32 tensor, by integer arithmetic on t's fp32 bits: inductor elides
    a ``.to(bf16).float()`` round trip inside a fused kernel (unless it emulates precision
    casts, which a user's ``torch.compile`` does not), and a check that compared the GEMM's
    product of the rounded operand with a reference of the unrounded one would raise false
    alarms (issue 55's tight bound). fp16: the normal range (a value fp16 holds only as a
    subnormal keeps more bits here, at most its 2^-24 spacing off; one beyond its range
    overflows the GEMM itself). A dtype it does not round (fp32, fp64) returns t as it is."""
    drop = _DROP.get(dtype)
    if drop is None or t.dtype == dtype:
        return t
    bits = t.to(torch.float32).view(torch.int32)
    half = (1 << (drop - 1)) - 1
    bits = (bits + (half + ((bits >> drop) & 1))) & -(1 << drop)
    return bits.view(torch.float32)
