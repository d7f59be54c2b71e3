"""Clean products are never flagged, and protection leaves them bit-for-bit unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnchecker.abft import encode, protected_matmul, recompute

from .helpers import DATA, DTYPES, operands


@given(
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    m=st.integers(1, 80),
    k=st.integers(1, 300),
    n=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES),
    log_scale=st.floats(-3, 4),
    data=st.sampled_from(DATA),
    seed=st.integers(0, 2**31),
)
def test_clean_products_are_never_flagged(batch, m, k, n, dtype, log_scale, data, seed):
    a, b = operands(batch, m, k, n, dtype=dtype, scale=10**log_scale, data=data, seed=seed)
    plain = a @ b
    c, report = protected_matmul(a, b)
    assert not report.detected.any()
    assert torch.equal(c, plain)  # nothing written but the values already there


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [1, 7, 77, 128, 200])
@pytest.mark.parametrize("check", ["both", "rows", "cols"])
def test_attention_shapes_are_never_flagged(dtype, L, check):
    """Scores Q K^T and context P V at BERT-like shapes, with real softmax probabilities."""
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(2, 3, L, 64, generator=g).to(dtype) for _ in range(3))
    scores, rep_s = protected_matmul(q, k.mT, check=check)
    probs = (scores.float() / 8).softmax(-1).to(dtype)
    _, rep_c = protected_matmul(probs, v, check=check)
    assert not rep_s.detected.any()
    assert not rep_c.detected.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_margin_of_the_tolerance(dtype):
    """The rounding error actually seen stays well inside the bound on realistic data."""
    a, b = operands((4, 12), 128, 64, 128, dtype=dtype, scale=30.0, data="normal", seed=1)
    sums = encode(a, b)
    rows, cols = recompute(a @ b)
    ratio = max(
        float(((sums.rows - rows).abs() / sums.row_tol).max()),
        float(((sums.cols - cols).abs() / sums.col_tol).max()),
    )
    assert ratio < 0.5


def test_projection_shape_under_cpu_bf16_autocast():
    """Under autocast the GEMM runs in bf16: the checksums must be encoded from the bf16 casts."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, 768, generator=g), torch.randn(768, 768, generator=g) / 28
    with torch.autocast("cpu", dtype=torch.bfloat16):
        c, report = protected_matmul(x, w)
    assert c.dtype == torch.bfloat16
    assert not report.detected.any()
