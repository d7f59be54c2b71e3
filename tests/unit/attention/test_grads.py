"""The backward engine (``attention.grads``) against autograd on random shapes: a checked linear
layer (nn.Linear's and Conv1D's layouts, with and without bias) and a checked batched matmul give
autograd's gradients and record nothing on clean data; a NaN / INF put into one of their
gradients by a site hook is corrected in the same backward and recorded in the sink's gradient
(its row: rows, cols, value, lost, reproduced, detected, step)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from attnchecker.attention.config import GRAD_OPS
from attnchecker.attention.grads import checked_linear, checked_matmul, new_records_sink

DETECTED = 5  # the sink rows' "detected" field
LINEAR_OPS = ((GRAD_OPS.index("dx.q"), "dx.q"), (GRAD_OPS.index("dw.q"), "dw.q"))


def _hit(site: str | None, value: float, where: tuple[int, int]):
    """A site hook that writes ``value`` into one element of the gradient named ``site``."""

    def hook(op: str, t: torch.Tensor) -> None:
        if op == site:
            t.view(-1, t.shape[-1])[where] = value

    return hook


def _linear_grads(x, w, b, conv1d, hook=None):
    """(dx, dw, db, sink rows) of sum(checked_linear(...) * g)."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    sink = new_records_sink(len(GRAD_OPS), x.device)
    step = torch.ones(1, dtype=torch.float64)
    y = checked_linear(x, w, b, sink, step, ops=LINEAR_OPS, check=(True, True), conv1d=conv1d,
                       max_rows=4, scale=1.0, hook=hook)  # fmt: skip
    g = torch.linspace(-1, 1, y.numel()).view(y.shape)
    (y * g).sum().backward()
    return x.grad, w.grad, None if b is None else b.grad, sink.grad


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 40), K=st.integers(1, 48), N=st.integers(1, 48), conv1d=st.booleans(),
    bias=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_checked_linear_layer_gives_autograds_gradients(T, K, N, conv1d, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, K, generator=g)
    w = torch.randn(K, N, generator=g) if conv1d else torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    dx, dw, db, rows = _linear_grads(x, w, b, conv1d)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = None if b is None else b.clone().requires_grad_()
    y = xr @ wr + (0 if br is None else br) if conv1d else F.linear(xr, wr, br)
    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    assert torch.allclose(dx, xr.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(dw, wr.grad, rtol=1e-5, atol=1e-6)
    if bias:
        assert torch.allclose(db, br.grad, rtol=1e-5, atol=1e-6)
    assert rows is None or not rows[:, DETECTED].any()  # clean: nothing recorded


@pytest.mark.parametrize("conv1d", [False, True], ids=["linear", "conv1d"])
@pytest.mark.parametrize("site", ["dx.q", "dw.q"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e30])
def test_a_bad_element_of_a_linear_layers_gradient_is_corrected(conv1d, site, value):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 12, 16, generator=g)
    w = torch.randn(16, 24, generator=g) if conv1d else torch.randn(24, 16, generator=g)
    b = torch.randn(24, generator=g)
    want = _linear_grads(x, w, b, conv1d)
    got = _linear_grads(x, w, b, conv1d, hook=_hit(site, value, (5, 3)))
    for a, b_ in zip(got[:3], want[:3], strict=True):
        assert torch.isfinite(a).all() and torch.allclose(a, b_, rtol=1e-5, atol=1e-5)
    row = got[3][GRAD_OPS.index(site)]
    assert row[DETECTED] == 1 and row[0] >= 1 and row[3] == 0  # detected, a row, not lost
    assert row[6] == 1  # at the clock's step


def _matmul_grads(a, b, ops, hook=None, **kw):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    sink = new_records_sink(len(GRAD_OPS), a.device)
    step = torch.ones(1, dtype=torch.float64)
    c = checked_matmul(a, b, sink, step, ops=ops, check=(True, True), max_heads=2, scale=1.0,
                       hook=hook, **kw)  # fmt: skip
    (c * torch.linspace(-1, 1, c.numel()).view(c.shape)).sum().backward()
    return a.grad, b.grad, sink.grad


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 2), H=st.integers(1, 3), M=st.integers(1, 24), K=st.integers(1, 16),
    N=st.integers(1, 24), probs=st.booleans(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_a_checked_batched_matmul_gives_autograds_gradients(B, H, M, K, N, probs, seed):
    """S = Q K^T (b transposed, gradients dQ and dK) or C = P V (P >= 0: dP and dV)."""
    g = torch.Generator().manual_seed(seed)
    if probs:  # P (B, H, M, K) rows on the simplex, V (B, H, K, N)
        a = torch.randn(B, H, M, K, generator=g).softmax(-1)
        b, ops, kw = torch.randn(B, H, K, N, generator=g), ("dp", "dv"), {"nonneg_a": True}
    else:  # Q (B, H, M, K), K^T (B, H, K, N)
        a = torch.randn(B, H, M, K, generator=g)
        b = torch.randn(B, H, N, K, generator=g).mT
        ops, kw = ("dq", "dk"), {"b_transposed": True}
    da, db, rows = _matmul_grads(a, b, ops, **kw)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    c = ar @ br
    (c * torch.linspace(-1, 1, c.numel()).view(c.shape)).sum().backward()
    assert torch.allclose(da, ar.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(db, br.grad, rtol=1e-5, atol=1e-6)
    assert rows is None or not rows[:, DETECTED].any()


@pytest.mark.parametrize("site", ["dq", "dk", "dp", "dv"])
def test_a_bad_element_of_a_batched_gradient_is_corrected(site):
    g = torch.Generator().manual_seed(5)
    if site in ("dp", "dv"):
        a = torch.randn(2, 3, 10, 12, generator=g).softmax(-1)
        b, ops, kw = torch.randn(2, 3, 12, 8, generator=g), ("dp", "dv"), {"nonneg_a": True}
    else:
        a = torch.randn(2, 3, 10, 8, generator=g)
        b = torch.randn(2, 3, 12, 8, generator=g).mT
        ops, kw = ("dq", "dk"), {"b_transposed": True}
    want = _matmul_grads(a, b, ops, **kw)
    got = _matmul_grads(a, b, ops, hook=_hit(site, float("nan"), (4, 2)), **kw)
    for x, y in zip(got[:2], want[:2], strict=True):
        assert torch.isfinite(x).all() and torch.allclose(x, y, rtol=1e-5, atol=1e-5)
    row = got[2][GRAD_OPS.index(site)]
    assert row[DETECTED] == 1 and row[3] == 0  # detected, not lost
