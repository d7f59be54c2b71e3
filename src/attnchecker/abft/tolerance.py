"""Dtype-aware tolerances for checksum comparisons.

A checked vector x of C = A @ B (a row: x_j = sum_k A_ik B_kj, j < n) has a reference checksum c
computed from the operands and a recomputed checksum r = sum_j x_j from the delivered output. In
exact arithmetic c = r. In floating point d = c - r is a sum of rounding errors, and each one is
bounded by a multiple of the *magnitude*

    m = sum_j sum_k |A_ik| |B_kj|        (sum_j w_j sum_k |A_ik| |B_kj| for weighted sums)

which the encoder computes from |A| and |B|, so it predates a fault in C like the checksum does.
With u_acc the unit roundoff of the accumulation (fp32, 2^-24) and u_out that of C's dtype, and
the classical worst-case bound gamma_n = n u for a sum of n terms in any order (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1):

1. the GEMM accumulates each x_j over k terms:    |err| <= k u_acc sum_k |A_ik B_kj|
2. rounding x_j to C's dtype (deterministic; dominant for bf16/fp16 outputs):
                                                   |err| <= u_out |x_j| <= u_out sum_k |A_ik B_kj|
3. the recomputed sum r over n elements:          |err| <= n u_acc m
4. the reference c = A_i (B e), n-term inner sums then a k-term dot product:
                                                   |err| <= (n + k) u_acc m

Summed over the vector: |d| <= (u_out + 2 (k + n) u_acc) m. Worst-case, not probabilistic,
bounds are used on purpose: the thin matrix-vector products that compute checksums accumulate
almost sequentially, and on structured data (constant rows, all-positive values) their errors
grow like n, not sqrt(n) (measured here: ~K/6 u m for K = 65,536 constant entries). Elements that
underflow lose up to one subnormal spacing each, which adds n * tiny * eps_out.

Accumulation is assumed in fp32: true for CPU kernels of every dtype and for CUDA unless
reduced-precision reductions are enabled for fp16/bf16 (then u_acc is the dtype's own roundoff).
An fp32 GEMM on CUDA with TF32 allowed rounds both operands to 10 mantissa bits first, which
adds 2 u_tf32 (u_tf32 = 2^-11) to every product's relative error.

**The GEMM checks' rounding-tight bound** (:func:`gemm_terms`; issue 55). The bound above charges
the output's rounding u_out to the magnitude m, which exceeds the row's L1 norm
A = sum_j |y_j| by ~0.8 sqrt(k) on random data (the products cancel): a bf16 check then sees
only errors of ~0.3 of the row (k = 768) and none below the row itself at k = 4,096. The GEMM
checks (projections, linear layers' y, dX and dW) split the bound in two terms, each charged to
what carries it:

    |c - r| <= floor + f_abs A + f_mag m,     A = sum_j |y^_j| (the delivered row, one more
                                              reduction in the pass that sums it)

- f_abs (deterministic): the rounding of each output to C's dtype, |y^ - y| <= u_out |y| <=
  u_out / (1 - u_out) |y^|; the recomputed sum, n fp32 terms in any order, n u_32 A; and the
  GEMM's accumulation where its partial sums move monotonically towards y_j (same-sign data,
  whose partial sums are bounded by |y_j|, rounded or truncated: 2 k u_32 |y_j|).
- f_mag (probabilistic): the GEMM's accumulation of signed products, whose rounding errors
  are independent and mean-zero in the standard model (Higham and Mary, "A new approach to
  probabilistic rounding error analysis", SISC 2019): the row's error is a sum of n k such
  errors, each at most u_acc times a partial sum bounded by its element's magnitude m_j, so by
  Azuma-Hoeffding |error| <= lambda sqrt(k) u_acc sqrt(sum_j m_j^2) <= lambda sqrt(k) u_acc m
  except with probability 2 exp(-lambda^2 / 2) (lambda = 8: 2.5e-14 a row; the last step,
  sum_j m_j^2 <= m^2, leaves a further sqrt(n) of margin on rows of n similar elements); the
  reference's k-term dot product the same in fp32; its sums of y, accumulated in fp64 (or
  split), rounded once to fp32 (u_32 m); TF32 as above.

The references must be the product of the operands *as the GEMM multiplied them* (autocast's
bf16 copy of an fp32 weight or input, rounded the same way), in fp32: a reference from the fp32
weight, or one rounded to bf16, adds u_bf16 m, the very term the split removes. With
reduced-precision reductions allowed (CUDA, fp16 / bf16), a split-K GEMM rounds its partials to
the output's dtype: u_acc is then the output's roundoff and f_mag loses the gain (read outside
traced code, like TF32). For bf16 at k = 4,096 the bound is ~0.004 A + 6e-5 m (~0.008 of the
row's L1 norm on random data), against ~0.3 of it with the magnitude-only bound.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "CAP",
    "LAMBDA",
    "accumulator_terms",
    "gemm_factor",
    "gemm_terms",
    "kernel_factor",
    "magnitude_factor",
    "norm_bound",
    "reduced_reductions",
    "squares_lost",
    "tf32_enabled",
    "tight_excess",
    "underflow_floor",
    "unit_roundoff",
]


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the machine epsilon: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def _accumulation_roundoff(dtype: torch.dtype, device: torch.device) -> float:
    if device.type == "cuda":
        m = torch.backends.cuda.matmul
        if dtype == torch.float16 and m.allow_fp16_reduced_precision_reduction:
            return unit_roundoff(torch.float16)
        if dtype == torch.bfloat16 and m.allow_bf16_reduced_precision_reduction:
            return unit_roundoff(torch.bfloat16)
    return unit_roundoff(torch.float32)


def magnitude_factor(
    out_dtype: torch.dtype, device: torch.device, *, inner: int, length: int
) -> float:
    """The factor f such that |c - r| <= f * m for one checked vector (see the module docstring).

    ``inner`` is the GEMM's reduction length k, ``length`` the number n of elements summed by
    the checksum of one vector.
    """
    factor = unit_roundoff(out_dtype) + 2 * (inner + length) * _accumulation_roundoff(
        out_dtype, device
    )
    if out_dtype == torch.float32 and device.type == "cuda" and tf32_enabled():
        factor += 2 * _U_TF32  # both operands rounded to TF32's 10 mantissa bits first
    return factor


_U_TF32 = 2.0**-11
_U32 = 2.0**-24

LAMBDA = 8.0
"""The probabilistic bound's multiple of sqrt(k) u (module docstring): a row's accumulation error
exceeds it with probability at most 2 exp(-LAMBDA^2 / 2) = 2.5e-14 in the standard model."""


CAP = 1 + 2.0**-6
"""A row's L1 norm A enters :func:`gemm_terms`'s bound as min(A, CAP M), M the magnitude bound
the check computes from the operands (Cauchy-Schwarz), which no clean row exceeds (|y^_j| <=
(1 + u_out) sum_k |x_k w_kj|): a fault that scales a whole row cannot widen its own tolerance
past f_abs CAP M, the operands' prediction (extreme whole-row errors stay seen as before), and
an INF in a row leaves its tolerance finite (the row fails by its sum; a NaN row by its NaN)."""


def reduced_reductions() -> list[str]:
    """The half dtypes whose CUDA GEMMs may reduce split-K partials in their own precision
    (torch's ``allow_bf16_reduced_precision_reduction`` / ``..._fp16_...``, bf16's on by default):
    their checks take u_acc = the dtype's roundoff (:func:`gemm_terms`), which leaves them only
    extreme errors. Set the flag False for the rounding-tight bound (cuBLAS then reduces in
    fp32)."""
    m = torch.backends.cuda.matmul
    flags = (("bf16", m.allow_bf16_reduced_precision_reduction),
             ("fp16", m.allow_fp16_reduced_precision_reduction))  # fmt: skip
    return [name for name, on in flags if on]


def gemm_terms(
    out_dtype: torch.dtype, device: torch.device, *, inner: int, length: int
) -> tuple[float, float]:
    """(f_abs, f_mag): a checked vector of ``length`` outputs of a GEMM with reduction length
    ``inner``, whose references are exact sums of the operands as the GEMM multiplied them,
    differs from its recomputed sum by at most f_abs A + f_mag m (A: the delivered vector's L1
    norm, m: its magnitude or an upper bound; the module docstring's rounding-tight bound)."""
    u = unit_roundoff(out_dtype)
    f_abs = u / (1 - u) + (length + 2 * inner) * _U32
    u_acc = _accumulation_roundoff(out_dtype, device)
    f_mag = LAMBDA * math.sqrt(inner) * (u_acc + _U32) + _U32
    if out_dtype == torch.float32 and device.type == "cuda" and tf32_enabled():
        f_mag += 2 * _U_TF32
    return f_abs, f_mag


def tight_excess(
    res: torch.Tensor, out: torch.Tensor, mag: torch.Tensor, *, inner: int, length: int,
    scale: float, rounded: int = 0, scaled: bool = False,
) -> torch.Tensor:  # fmt: skip
    """|res| less the rounding-tight tolerance of the rows of ``out`` (..., ``length``), a GEMM of
    ``operands`` with reduction length ``inner``, whose rows' magnitudes are at most ``mag``
    (...) and whose residuals are ``res`` (...) against fp32 references of the operands as the
    GEMM multiplied them: floor + scale (f_abs min(A, CAP mag) + f_mag mag) (:func:`gemm_terms`,
    A the delivered row's L1 norm: one pass, no copy). ``rounded``: how many operands the GEMM
    rounded to the output's dtype (autocast) that the reference took unrounded: each one's
    roundoff joins f_mag; ``scaled``: a scaling inside the GEMM (a folded alpha), rounded once
    more, joins f_abs. > 0 (or NaN)
    where a row is flagged. The eager checks of the attention core (forward and backward) use it;
    the projections' and linear layers' checks compute the same terms in their own passes."""
    f_abs, f_mag = gemm_terms(out.dtype, out.device, inner=inner, length=length)
    u = unit_roundoff(out.dtype)
    f_mag += rounded * u
    if scaled:
        f_abs += u / (1 - u)
    l1 = torch.linalg.vector_norm(out, 1, dim=-1, dtype=torch.float32)
    excess = torch.sub(res.abs(), torch.minimum(l1, mag * CAP), alpha=f_abs * scale)
    floor = underflow_floor(out.dtype, length=length, inner=inner)
    return excess.sub_(mag, alpha=f_mag * scale).sub_(floor)


def accumulator_terms(
    operand: torch.dtype, *, inner: int, length: int, block_n: int, block_k: int
) -> tuple[float, float, float]:
    """(f_sum, f_ref, f_acc) of a row checked on a GEMM's fp32 accumulator
    (:mod:`attnchecker.kernels.acc_gemm`): the row's accumulated values acc_j (j < ``length``,
    each a sum of ``inner`` exact products of ``operand``s) summed in the kernel's own order,
    against x . s (s = y 1, accumulated in fp64 and rounded once to fp32), differ by at most
    f_sum A + f_ref Q + f_acc ||x|| ||y||_F, where

    - A = sum_j |acc_j| (the accumulator row's L1 norm): the recomputed sum, a tree over each
      tile of ``block_n`` columns (ceil(log2 block_n) roundings deep) then one add a tile in
      order, deterministic: (ceil(log2 block_n) + ceil(length / block_n) + 1) u_32 (the +1: the
      bias added to each element);
    - Q = sum_k |x_k| |s_k|: the reference, s rounded once (u_32), each product rounded, a tree
      over each ``block_k`` tile and one add a tile: (ceil(log2 block_k) + ceil(inner /
      block_k) + 2) u_32;
    - ||x|| ||y||_F: the GEMM's own accumulation of signed products, probabilistic as in
      :func:`gemm_terms` (LAMBDA sqrt(inner), Azuma-Hoeffding over the row's length x inner
      rounding errors, each at most 2 u_32 of a partial sum bounded by its element's magnitude
      m_j: matrix units may truncate, not round, as they accumulate; sqrt(sum_j m_j^2) <= ||x||
      ||y||_F by Cauchy-Schwarz, no further sqrt(length)). Truncation is biased towards zero
      per element; over a row of signed elements the biases cancel like the errors, and the
      GPU stage (``benchmarks/gemm_bounds.py``) measures how much of this term a device uses.
      fp32 operands are multiplied in IEEE fp32 (the kernel never uses TF32): u_32 per product
      more, inside the same term.

    No rounding to the output's dtype enters: the check reads the accumulator. For bf16 at
    inner = length = 4,096 the bound is ~8e-5 of the row's L1 norm on random data (~0.008 for
    the delivered-output check, :func:`gemm_terms`)."""
    depth_n = math.ceil(math.log2(max(block_n, 2)))
    depth_k = math.ceil(math.log2(max(block_k, 2)))
    f_sum = (depth_n + math.ceil(length / block_n) + 1) * _U32
    f_ref = (depth_k + math.ceil(inner / block_k) + 2) * _U32
    per_product = 2 * _U32 + (_U32 if operand == torch.float32 else 0.0)
    f_acc = LAMBDA * math.sqrt(inner) * per_product
    return f_sum, f_ref, f_acc


def gemm_factor(out: torch.Tensor, *operands: torch.Tensor, inner: int, length: int) -> float:
    """:func:`magnitude_factor` of a checked vector of ``out`` = a GEMM of ``operands``; an
    operand wider than the output (autocast) was rounded to the output's dtype before the GEMM,
    which adds one rounding of that operand to every product. The tolerance of every eager
    check (forward, backward, linear layers)."""
    rounded = sum(op.dtype != out.dtype for op in operands)
    return magnitude_factor(
        out.dtype, out.device, inner=inner, length=length
    ) + rounded * unit_roundoff(out.dtype)


def kernel_factor(operand: torch.dtype, *, inner: int, length: int, tf32: bool) -> float:
    """The factor f such that |c - r| <= f * m for a checksum inside the fused attention
    kernels (``attnchecker.kernels``), in the module docstring's model: the checked values are
    fp32 accumulators (no rounding to an output dtype), products of fp16 / bf16 operands are
    exact in fp32, and a matrix unit may truncate instead of rounding to nearest as it
    accumulates (twice the unit roundoff: 2 (inner + length) 2 u_32); fp32 operands on TF32
    MMAs (``tf32``) add 2 u_tf32. ``inner``: the reduction length behind each checked value,
    ``length``: the values summed by the checksum."""
    factor = 4 * (inner + length) * unit_roundoff(torch.float32)
    if operand == torch.float32 and tf32:
        factor += 2 * _U_TF32
    return factor


_TF32 = False  # what tf32_enabled() last read in eager code


def tf32_enabled() -> bool:
    """Whether fp32 GEMMs on CUDA may run on TF32 tensor cores (``allow_tf32`` or a float32
    matmul precision other than "highest").

    Read in eager code (``protect_``, every ``drain()``, any eager check); inside traced code
    (a check region, a model the user compiles) the value of the last eager read: dynamo cannot
    call ``torch.get_float32_matmul_precision`` (it returns a str), and it guards on the module
    global it reads instead, so a precision changed and read again in eager code recompiles."""
    global _TF32
    if torch.compiler.is_compiling():
        return _TF32
    _TF32 = bool(
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )
    return _TF32


# fp32's smallest normal number: the most an fp32 product or sum that underflows can lose, also
# where it is flushed to zero (measured: CPU bf16 GEMMs flush; GPU kernels may run FTZ)
_TINY32 = 2.0**-126


def underflow_floor(out_dtype: torch.dtype, *, length: int, inner: int = 0) -> float:
    """Absolute slack of a checksum of ``length`` elements of a GEMM with reduction length
    ``inner``: each element rounded to ``out_dtype`` loses up to one of its subnormal spacings,
    and each of the ~2 ``inner`` fp32 products and sums behind an element, the ``length`` sums
    of the recomputed checksum and the ``inner`` + ``length`` ones of its reference each lose up
    to fp32's smallest normal where they underflow (flushed to zero at worst): (length + 1)
    (2 inner + 1) of them, below 1e-28 at any GEMM size of a transformer, so it never hides a
    fault that matters (INF, NaN, near-INF, or any error above 1e-20)."""
    fi = torch.finfo(out_dtype)
    return length * fi.smallest_normal * fi.eps + (length + 1) * (2 * inner + 1) * _TINY32


def norm_bound(x: torch.Tensor, dim: int | tuple[int, ...], *, keepdim: bool = False):
    """An upper bound on ||x||_2 over ``dim``, fp32, that does not collapse where the squares
    underflow.

    ``torch.linalg.vector_norm`` squares in fp32 (bf16 and fp16 inputs too): an element below
    ~1e-19 has a square below fp32's normal range, which keeps a few bits or none (1e-23
    squares to 0). A row of such elements, as a near one-hot softmax gives its gradient, has a
    norm that collapses by orders of magnitude, and a rounding bound built from it collapses
    with it (a false alarm on a healthy row). Each square loses at most fp32's smallest normal
    2^-126 (flushed to zero at worst), so ||x||^2 <= computed^2 + n 2^-126 over n elements: the
    bound is computed + sqrt(n 2^-126) (>= their hypot), one op on the (small) result, no pass
    over x; it never drops below ~1e-19 sqrt(n), and is the computed norm exactly where that is
    above ~1e-12 sqrt(n). Elements
    above ~1.8e19 overflow the squares: the bound is INF and a check built on it passes
    everything but NaN; such operands are near-INF themselves, for the check upstream (or the
    reproduced test) to report.
    """
    dims = (dim,) if isinstance(dim, int) else dim
    n = 1
    for d in dims:  # (a loop: torch.compile traces no generator inside autograd.Function)
        n *= x.shape[d]
    computed = torch.linalg.vector_norm(x, dim=dims, keepdim=keepdim, dtype=torch.float32)
    return computed + squares_lost(n)  # >= hypot(computed, squares_lost(n)); = computed if large


def squares_lost(n: int) -> float:
    """sqrt(n 2^-126): the most an fp32 norm of ``n`` elements can lose to squares that
    underflow (see :func:`norm_bound`)."""
    return math.sqrt(n * _TINY32)
