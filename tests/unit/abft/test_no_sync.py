"""The clean path is tensor-only: under fake tensors, any .item(), bool(tensor) or data-dependent
shape would raise, because fake tensors carry shapes but no values."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from attnchecker.abft import protected_matmul


@pytest.mark.parametrize("check", ["both", "rows", "cols"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_protected_matmul_never_reads_tensor_values(check, dtype):
    with FakeTensorMode():
        q = torch.randn(2, 3, 37, 16, dtype=dtype)
        k = torch.randn(2, 3, 37, 16, dtype=dtype)
        c, rep = protected_matmul(
            q, k.mT, check=check, corrupt=lambda c: c[0, 0, 1].fill_(float("inf"))
        )
        counts = rep.counts()
    assert c.shape == (2, 3, 37, 37)
    assert rep.detected.shape == (2, 3)
    assert counts["corrected"].shape == ()
