"""The one tolerance model: every eager check's factor (``gemm_factor``) and the fused kernels'
(``kernel_factor``) come from the same unit roundoffs and reduction lengths."""

from __future__ import annotations

import torch

from attnchecker.abft.tolerance import (
    gemm_factor,
    kernel_factor,
    magnitude_factor,
    unit_roundoff,
)

CPU = torch.device("cpu")


def test_gemm_factor_adds_one_rounding_per_operand_wider_than_the_output():
    out = torch.zeros(2, 2, dtype=torch.bfloat16)
    same, wide = torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2)
    base = magnitude_factor(torch.bfloat16, CPU, inner=64, length=32)
    assert gemm_factor(out, same, same, inner=64, length=32) == base
    u = unit_roundoff(torch.bfloat16)
    assert gemm_factor(out, wide, same, inner=64, length=32) == base + u  # autocast's cast
    assert gemm_factor(out, wide, wide, inner=64, length=32) == base + 2 * u


def test_kernel_factor_grows_with_the_reduction_and_tf32():
    f = kernel_factor(torch.bfloat16, inner=64, length=64, tf32=False)
    assert f == 4 * 128 * unit_roundoff(torch.float32)  # truncating accumulation: 2 x 2u
    assert kernel_factor(torch.bfloat16, inner=4096, length=64, tf32=False) > f
    assert kernel_factor(torch.bfloat16, inner=64, length=64, tf32=True) == f  # fp32 only
    tf32 = kernel_factor(torch.float32, inner=64, length=64, tf32=True)
    assert tf32 == f + 2 * 2.0**-11  # both operands rounded to 10 mantissa bits
