"""Clean rows of tiny magnitude are never flagged, forward or backward (issue 21).

A near one-hot softmax gives its gradient rows of ~1e-22 and smaller; outlier features push
activations the other way. A rounding bound built from fp32 norms collapses there (the squares
of elements below ~1e-19 underflow: 1e-23 squares to 0), and a healthy row is reported as an
uncorrectable fault. Each check primitive runs here on clean operands where some rows (or whole
operands) are scaled to 1e-15 .. 1e-35 in fp32 / bf16 (fp16: down to its subnormal range).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from attnchecker.abft.tolerance import norm_bound
from attnchecker.attention.checks import (
    Projection,
    projection_check_,
    row_limits,
)
from attnchecker.attention.grads import checked_linear, checked_matmul, new_records_sink
from attnchecker.attention.heads import context_residual, scores_residual

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# log10 of the tiny rows' scale: fp32 and bf16 share fp32's exponent range; fp16's smallest
# subnormal is 6e-8, so its tiny rows stop at its subnormal range
LOG_SCALE = {"fp32": (-35, -15), "bf16": (-35, -15), "fp16": (-7, -4)}
EXAMPLES = settings(max_examples=max(8, settings().max_examples // 4))


def _operand(shape, dtype, g: torch.Generator, *, log_scale: float, frac: float) -> Tensor:
    """Normal values with a fraction ``frac`` of the rows (all of them at 1.0) scaled to
    10**log_scale, and inside those rows one dominant entry 100x the rest (as near one-hot
    softmax gradients are)."""
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    rows = torch.rand(shape[:-1], generator=g, dtype=torch.float64) < frac
    peak = torch.randint(0, shape[-1], shape[:-1], generator=g)
    spiky = x * 0.01
    spiky.scatter_(-1, peak.unsqueeze(-1), x.gather(-1, peak.unsqueeze(-1)))
    x = torch.where(rows.unsqueeze(-1), spiky * 10.0**log_scale, x)
    return x.to(dtype)


def _case(dtype: str, log_scale: float, seed: int) -> tuple[float, torch.dtype, torch.Generator]:
    """log10 of the tiny rows' scale (``log_scale`` in [0, 1] across the dtype's range), the
    dtype and a seeded generator."""
    lo, hi = LOG_SCALE[dtype]
    return lo + (hi - lo) * log_scale, DTYPES[dtype], torch.Generator().manual_seed(seed)


def test_norm_bound_does_not_collapse():
    """fp32's norm of 1e-23 entries is 0; the bound is the true norm up to a few subnormal
    spacings, and exact to rounding where nothing underflows."""
    for dt in DTYPES.values():
        x = torch.full((4, 64), 1e-23 if dt != torch.float16 else 1e-7).to(dt)
        true = torch.linalg.vector_norm(x.double(), dim=-1)
        assert (norm_bound(x, -1).double() >= true * (1 - 1e-6)).all()
        y = torch.randn(4, 64).to(dt)
        ref = torch.linalg.vector_norm(y, dim=-1, dtype=torch.float32)
        assert torch.allclose(norm_bound(y, -1), ref, rtol=1e-6, atol=0)
    assert (torch.linalg.vector_norm(torch.full((64,), 1e-23)) == 0).all()  # the collapse


@EXAMPLES
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    log_scale=st.floats(0, 1),
    frac=st.sampled_from([0.1, 0.5, 1.0]),
    b_transposed=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_core_gradients_of_tiny_rows_are_never_flagged(dtype, log_scale, frac, b_transposed, seed):
    """dQ / dK (scores q k^T) and dP / dV (context p v): the incoming gradient (dS, dO) has
    tiny rows."""
    ls, dt, g = _case(dtype, log_scale, seed)
    B, H, L, d = 2, 2, 24, 16
    if b_transposed:  # scores: a = q (B, H, L, d), b = k^T
        a = torch.randn(B, H, L, d, generator=g).to(dt).requires_grad_()
        b = torch.randn(B, H, L, d, generator=g).to(dt).mT.requires_grad_()
        ops = ("dq", "dk")
    else:  # context: a = p >= 0 (B, H, L, L), b = v
        a = torch.softmax(torch.randn(B, H, L, L, generator=g) * 8, -1).to(dt).requires_grad_()
        b = torch.randn(B, H, L, d, generator=g).to(dt).requires_grad_()
        ops = ("dp", "dv")
    sink = new_records_sink(8, a.device)
    step = torch.zeros(1, dtype=torch.float64)
    out = checked_matmul(
        a, b, sink, step, ops=ops, check=(True, True), max_heads=2, scale=1.0,
        nonneg_a=not b_transposed, b_transposed=b_transposed,
    )  # fmt: skip
    grad = _operand(out.shape, dt, g, log_scale=ls, frac=frac)
    out.backward(grad)
    assert sink.grad is not None and (sink.grad == 0).all(), f"false alarm: {sink.grad.tolist()}"


@EXAMPLES
@pytest.mark.parametrize("dtype", DTYPES)
@given(
    log_scale=st.floats(0, 1),
    frac=st.sampled_from([0.1, 0.5, 1.0]),
    conv1d=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_linear_gradients_of_tiny_rows_are_never_flagged(dtype, log_scale, frac, conv1d, seed):
    """dX and dW of a linear layer (all_linear's checks) when dY has tiny token rows."""
    ls, dt, g = _case(dtype, log_scale, seed)
    T, K, N = 40, 32, 48
    x = torch.randn(T, K, generator=g).to(dt).requires_grad_()
    w = torch.randn(*((K, N) if conv1d else (N, K)), generator=g).to(dt).requires_grad_()
    sink = new_records_sink(2, x.device)
    step = torch.zeros(1, dtype=torch.float64)
    y = checked_linear(
        x, w, None, sink, step, ops=((0, "dx"), (1, "dw")), check=(True, True), conv1d=conv1d,
        max_rows=4, scale=1.0,
    )  # fmt: skip
    y.backward(_operand(y.shape, dt, g, log_scale=ls, frac=frac))
    assert (sink.grad == 0).all(), f"false alarm: {sink.grad.tolist()}"


@EXAMPLES
@pytest.mark.parametrize("dtype", DTYPES)
@given(log_scale=st.floats(0, 1), frac=st.sampled_from([0.1, 1.0]), seed=st.integers(0, 2**31))
def test_forward_checks_of_tiny_rows_are_never_flagged(dtype, log_scale, frac, seed):
    """Scores with tiny query rows, the context of tiny value rows, a projection of tiny
    token rows."""
    ls, dt, g = _case(dtype, log_scale, seed)
    B, H, L, d = 2, 2, 24, 16
    q = _operand((B, H, L, d), dt, g, log_scale=ls, frac=frac)
    k = _operand((B, H, L, d), dt, g, log_scale=ls, frac=frac)
    s = q @ k.mT
    assert (scores_residual(s, q, k)[1] <= 0).all()
    p = torch.softmax(torch.randn(B, H, L, L, generator=g) * 8, -1).to(dt)
    v = _operand((B, H, L, d), dt, g, log_scale=ls, frac=frac)
    assert (context_residual(p @ v, p, v)[1] <= 0).all()
    x = _operand((1, L, 32), dt, g, log_scale=ls, frac=frac)
    w = (torch.randn(3 * d, 32, generator=g) * 0.1).to(dt)
    y = torch.nn.functional.linear(x, w)
    pairs = [(Projection(w, None, False, ("q", "k", "v"), 3, (), False), y)]
    rec = projection_check_(x, pairs, max_rows=4, **row_limits(x, pairs, 1.0))[0]
    assert (rec[:, :2] == 0).all(), f"false alarm: {rec.tolist()}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("log_scale", [-25.0, -21.0])
def test_a_conv1d_projection_with_tiny_weight_columns_is_never_flagged(dtype, log_scale):
    """GPT-2's Conv1D (weight stored (in, out)): its output columns' weight norms are summed
    over dim 0 by hand (not norm_bound), so they carry the underflow floor themselves
    (``squares_lost``); columns of ~1e-25 weights square to 0 in fp32."""
    dt, g = DTYPES[dtype], torch.Generator().manual_seed(7)
    L, K, d = 24, 32, 16
    x = torch.randn(1, L, K, generator=g).to(dt)
    w = _operand((3 * d, K), torch.float32, g, log_scale=log_scale, frac=0.5).t().contiguous()
    w = w.to(dt)  # (K, 3d): Conv1D's layout, half its output columns tiny
    y = torch.addmm(torch.zeros(3 * d, dtype=dt), x.view(L, K), w).view(1, L, 3 * d)
    pairs = [(Projection(w, None, True, ("q", "k", "v"), 3, (), False), y)]
    rec = projection_check_(x, pairs, max_rows=4, **row_limits(x, pairs, 1.0))[0]
    assert (rec[:, :2] == 0).all(), f"false alarm: {rec.tolist()}"
