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
"""

from __future__ import annotations

import torch

__all__ = ["magnitude_factor", "underflow_floor", "unit_roundoff"]


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
    if out_dtype == torch.float32 and device.type == "cuda" and _tf32(device):
        factor += 2 * _U_TF32  # both operands rounded to TF32's 10 mantissa bits first
    return factor


_U_TF32 = 2.0**-11


def _tf32(device: torch.device) -> bool:
    """Whether fp32 GEMMs on CUDA may run on TF32 tensor cores (``allow_tf32`` or a float32
    matmul precision other than "highest")."""
    return (
        torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    )


def underflow_floor(out_dtype: torch.dtype, *, length: int) -> float:
    """Absolute slack for ``length`` elements each losing up to one subnormal spacing."""
    fi = torch.finfo(out_dtype)
    return length * fi.smallest_normal * fi.eps
