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


def test_the_cuda_branch_of_the_tolerance_traces_and_follows_the_precision():
    """On CUDA in fp32 the factor asks whether TF32 may run; inside traced code (a check region,
    a model the user compiles) dynamo cannot call torch.get_float32_matmul_precision (a str):
    the regions fell back to eager ops on the GPU for the rest of the process. The branch needs
    only a device whose type is "cuda", so it runs here: fullgraph compiles, equals eager, and a
    precision changed (and read in eager code, as protect_ and every drain() do) is followed."""
    import torch._dynamo

    from attnchecker.abft.tolerance import tf32_enabled

    cuda = torch.device("cuda")

    def factor(x: torch.Tensor) -> torch.Tensor:
        return x * magnitude_factor(torch.float32, cuda, inner=64, length=32)

    before = torch.get_float32_matmul_precision()
    torch._dynamo.reset()
    run = torch.compile(factor, fullgraph=True, backend="eager")
    try:
        torch.set_float32_matmul_precision("highest")
        tf32_enabled()
        ieee = float(run(torch.ones(1)))
        assert ieee == magnitude_factor(torch.float32, cuda, inner=64, length=32)
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert tf32_enabled()
        assert float(run(torch.ones(1))) == ieee + 2 * 2.0**-11  # recompiled on the new read
        for dtype in (torch.float16, torch.bfloat16):  # their reduced-precision switches trace
            half = torch.compile(
                lambda x, d=dtype: x * magnitude_factor(d, cuda, inner=64, length=32),
                fullgraph=True, backend="eager",
            )  # fmt: skip
            assert float(half(torch.ones(1))) == magnitude_factor(dtype, cuda, inner=64, length=32)
    finally:
        torch.set_float32_matmul_precision(before)
        tf32_enabled()
        torch._dynamo.reset()
