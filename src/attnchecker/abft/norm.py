"""The normalisations' check: each output row against the row recomputed from its input, per
element, with a derived rounding bound. Pure tensor math.

A normalisation ``y = g * (x - mu) * rs + b`` (LayerNorm; RMSNorm has ``mu = 0`` and no ``b``;
``rs = rsqrt(mean((x - mu)^2) + eps)``, ``g`` the gain: the weight, ``1 + weight`` in Gemma,
or none) is recomputed here in fp32 from the input the module received, and every delivered
element is compared with it. A row is flagged where one element differs by more than

    tol_i = 2 u_out (|y_i| + |r_i| + |b_i|) + (d + 4) u_32 |g_i| rs (|x_i - mu| + |x_i| + mean|x|)
            + 2 s (|w_i| + 1)

(d the row's width, r_i the reference, s the larger subnormal spacing of the two dtypes: below
the smallest normal number a rounding's error is absolute, fp16's 2^-24; u_out the larger unit
roundoff of the output's and the input's dtypes). The first term is the output's rounding,
counted twice over: an implementation may round ``x * rs`` to the output dtype before the gain
multiplies it (Llama's RMSNorm does), then round the product, and add the bias after. The second
is the fp32 arithmetic: the row's mean square (and mean) are sums of d terms, each within ``d
u_32`` of the exact value in any summation order (Higham, gamma_n), so ``rs`` is within ``(d / 2
+ 2) u_32`` relatively and ``x_i - mu`` within ``u_32 (|x_i| + d mean|x|)``; the subtraction's
own rounding and ``eps``'s are inside the ``+ 4``. Worst-case on purpose, like every tolerance
of the package (``tolerance.py``). The comparison is per element, so an error is seen once it
exceeds a few ulps of *its own* element (bf16: ~2^-7 of the element), far below a row checksum's
sensitivity; a checksum over ``y`` alone would need ``mean(x^2)``, one pass over ``x`` all the
same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["NormSpec", "reference", "row_excess", "subnormal_floor"]

_U32 = 2.0**-24


@dataclass(frozen=True)
class NormSpec:
    """What a normalisation computes over its last dimension: ``rms`` (no mean) or ``layer``,
    its ``eps``, and whether its gain is ``1 + weight`` (Gemma) rather than the weight."""

    kind: str  # "rms" | "layer"
    eps: float
    offset: bool = False  # gain = 1 + weight


def _gain(spec: NormSpec, weight: Tensor | None, like: Tensor) -> Tensor:
    if weight is None:
        return torch.ones((), dtype=torch.float32, device=like.device)
    w = weight.detach().float()
    return w + 1.0 if spec.offset else w


def reference(
    spec: NormSpec, x: Tensor, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(y, bound)``: the normalisation of ``x`` (rows over the last dim, fp32) and each
    element's fp32 arithmetic bound (the second term of the module docstring)."""
    h = x.detach().float()  # (..., d)
    d = h.shape[-1]
    if spec.kind == "layer":
        mu = h.mean(-1, keepdim=True)
        c = h - mu
    else:
        mu, c = None, h
    rs = torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + spec.eps)  # (..., 1)
    g = _gain(spec, weight, h)
    y = g * (c * rs)
    if bias is not None:
        y = y + bias.detach().float()
    spread = c.abs() + h.abs()
    if mu is not None:
        spread = spread + h.abs().mean(-1, keepdim=True)
    bound = (d + 4) * _U32 * g.abs() * rs * spread
    return y, bound


def subnormal_floor(x: Tensor, y: Tensor, weight: Tensor | None) -> Tensor | float:
    """The absolute part of the roundings: below the smallest normal number of a dtype its
    spacing is fixed (fp16: 2^-24, six orders above bf16's), so an element rounded to the
    input's or the output's dtype may be off by that much however small it is; counted twice (two
    roundings), times the gain for the first."""
    spacing = max(torch.finfo(t.dtype).tiny * torch.finfo(t.dtype).eps for t in (x, y))
    gain = 1.0 if weight is None else weight.detach().float().abs() + 1.0
    return 2 * spacing * gain


def row_excess(
    spec: NormSpec, x: Tensor, y: Tensor, weight: Tensor | None, bias: Tensor | None,
    *, scale: float = 1.0,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(excess, ref)``: per row of ``y`` (flattened to (rows, d)), the largest amount by which
    an element exceeds its tolerance (> 0: flagged; +inf for a non-finite element), and the
    fp32 reference rows."""
    ref, bound = reference(spec, x, weight, bias)
    # the output's rounding, or the input dtype's: an implementation may round x * rs back to
    # the input dtype before a gain of another dtype multiplies it (Qwen3's q_norm under
    # autocast: bf16 x * rs, an fp32 weight, an fp32 output)
    u_out = max(torch.finfo(t.dtype).eps / 2 for t in (x, y))
    got = y.detach().float()
    b = 0.0 if bias is None else bias.detach().float().abs()
    floor = subnormal_floor(x, y, weight)
    tol = scale * (2 * u_out * (got.abs().nan_to_num(0.0, 0.0, 0.0) + ref.abs() + b) + bound
                   + floor)  # fmt: skip
    err = (got - ref).abs().nan_to_num(float("inf"), float("inf"), float("inf"))
    d = y.shape[-1]
    excess = (err - tol).reshape(-1, d).amax(-1)  # (rows,)
    return excess, ref.reshape(-1, d)
