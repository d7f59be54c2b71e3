"""Gradients through a corrected product equal the fault-free gradients."""

from __future__ import annotations

import pytest
import torch

from attnchecker.abft import protected_matmul


def _grads(q, k, v, corrupt):
    scores, rep = protected_matmul(q, k.mT, corrupt=corrupt)  # (B, nh, L, L)
    probs = (scores / 8).softmax(-1)  # saves the corrected scores for backward
    ctx, _ = protected_matmul(probs, v)  # (B, nh, L, d)
    loss = ctx.square().mean()
    return loss.detach(), torch.autograd.grad(loss, (q, k, v)), rep


@pytest.mark.parametrize(
    "fault",
    [
        lambda c: c[1, 0, 7, 3].fill_(float("nan")),
        lambda c: c[0, 1, 9].fill_(float("inf")),
        lambda c: c[0, 0, :, 30].fill_(1e10),
    ],
    ids=["0D-nan", "1R-inf", "1C-1e10"],
)
def test_gradients_equal_fault_free(fault):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 48, 16, generator=g, requires_grad=True) for _ in range(3))
    loss0, grads0, _ = _grads(q, k, v, None)
    loss1, grads1, rep = _grads(q, k, v, fault)
    assert rep.corrected.sum() == 1
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    for g1, g0 in zip(grads1, grads0, strict=True):
        # corrected elements equal the clean ones up to a few ulps of rounding order
        torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)


def test_unprotected_fault_poisons_gradients():
    """The control: without correction the same fault reaches the gradients."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 16, 8, generator=g, requires_grad=True) for _ in range(2))
    s = q @ k.mT
    with torch.no_grad():
        s[0, 0, 3, 4] = float("nan")
    grad_q = torch.autograd.grad(s.softmax(-1).square().sum(), q)[0]
    assert grad_q.isnan().any()


def test_broadcast_weight_operand():
    """A batched input against one shared weight matrix, as a projection: grads of the weight
    are reduced over the batch by autograd as usual."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 32, 24, generator=g, requires_grad=True)
    w = torch.randn(24, 40, generator=g, requires_grad=True)
    y0, _ = protected_matmul(x, w)
    grads0 = torch.autograd.grad(y0.tanh().sum(), (x, w))
    y1, rep = protected_matmul(x, w, corrupt=lambda c: c[2, 5, 6].fill_(float("-inf")))
    grads1 = torch.autograd.grad(y1.tanh().sum(), (x, w))
    assert rep.corrected[2] and rep.detected.sum() == 1
    for g1, g0 in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(g1, g0)


def test_corrupt_may_return_a_replacement():
    a, b = torch.randn(5, 6), torch.randn(6, 7)
    clean = a @ b

    def replace(c):
        out = c.clone()
        out[2, 3] = float("nan")
        return out

    c, rep = protected_matmul(a, b, corrupt=replace)
    assert rep.corrected.item() and torch.allclose(c, clean)
    with pytest.raises(ValueError, match="corrupt returned shape"):
        protected_matmul(a, b, corrupt=lambda c: torch.zeros(3))
