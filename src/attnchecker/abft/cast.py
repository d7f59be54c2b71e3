"""The operands a lower-precision op really multiplies under autocast, defined once.

A check must see what the GEMM (or SDPA) multiplied, not what the model handed it: under
``torch.autocast`` a lower-precision op casts its floating-point inputs, other than fp64, to the
autocast dtype. The autograd functions save those casts, the SDPA route and the fused kernels
take them, the checks' references are computed from them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["autocast_operands"]


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
