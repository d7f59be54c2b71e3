"""One protected matmul, end to end: encode from the operands, multiply, verify, correct.

``protected_matmul(a, b)`` returns ``(c, report)`` where ``c`` is ``a @ b`` with any detected
error corrected in place, and ``report`` is a tensor-only :class:`~attnchecker.abft.eec.Report`.
It works under autograd: the product is an ordinary ``torch.matmul`` node and the correction
edits its output in place without recording anything, so the gradients with respect to ``a``
and ``b`` are exactly those of the fault-free product, and any later op that saves ``c`` for
backward saves the corrected values.

``corrupt`` is the fault-injection point: a callable that receives the product between the
multiply and the verification and either edits it in place (returning None or a view, which is
ignored) or returns a new tensor of the same shape that replaces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnchecker.abft.cast import autocast_operands
from attnchecker.abft.checksum import BOTH, encode
from attnchecker.abft.eec import Report, correct_

__all__ = ["Corruptor", "protected_matmul"]

Corruptor = Callable[[Tensor], Tensor | None]


def _compute_operands(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The operands the GEMM really multiplies: under autocast, their low-precision casts."""
    if torch.is_autocast_enabled(a.device.type):
        return autocast_operands(a, b)
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt), b.to(dt)


def protected_matmul(
    a: Tensor,
    b: Tensor,
    *,
    check: str = BOTH,
    corrupt: Corruptor | None = None,
    lines: bool = True,
    a_abs: Tensor | None = None,
    b_abs: Tensor | None = None,
) -> tuple[Tensor, Report]:
    """``a @ b`` for a (..., M, K), b (..., K, N) with checksum verification and correction.

    ``check`` selects the checked vectors: ``"rows"``, ``"cols"`` or ``"both"`` (the default;
    it corrects 0D errors, and whole bad rows and columns when ``lines`` is on; one direction
    alone corrects 0D only). ``lines=False`` keeps the always-on correction work at
    O(M + N + K) per matrix instead of reading both operands again. ``a_abs`` / ``b_abs`` are
    the magnitude hints of :func:`~attnchecker.abft.checksum.encode`.
    """
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(
            f"operands must be at least 2-D, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    a, b = _compute_operands(a, b)
    a_d, b_d = a.detach(), b.detach()
    sums = encode(a_d, b_d, check=check, a_abs=a_abs, b_abs=b_abs)
    c = torch.matmul(a, b)  # (..., M, K) @ (..., K, N) -> (..., M, N)
    if corrupt is not None:
        with torch.no_grad():
            out = corrupt(c)
            if out is not None and out is not c and out._base is None:  # a replacement, not a view
                if out.shape != c.shape:
                    raise ValueError(
                        f"corrupt returned shape {tuple(out.shape)}, expected {tuple(c.shape)}"
                    )
                c.copy_(out)
    return c, correct_(c, sums, a_d, b_d, lines=lines)
