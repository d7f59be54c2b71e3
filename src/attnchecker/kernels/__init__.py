"""Fused attention kernels with checksums inside (Triton), for the ``backend="triton"`` path.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set
before this package is imported: the kernels are decorated at import), which computes through
numpy: slow, for tests only, and unable to compute in bf16, so bf16 operands are upcast to fp32
there (``interpreting()``).
"""

from __future__ import annotations

import os

__all__ = ["KERNEL_SITES", "available", "interpreting"]

KERNEL_SITES = ("s", "pv", "st", "dpt", "dv", "dk", "sq", "dp", "dq")
"""The GEMMs of the fused kernels a fault can hit (``kernels.flash.SITES``; named here, where
nothing imports triton, so fault plans validate without it)."""


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """Whether the kernels can run here: triton importable, and CUDA or the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    import torch

    return interpreting() or torch.cuda.is_available()
