"""recovery.guard on a plain model with the flag given: a flagged step leaves parameters and
optimizer state exactly as they were, on every path (fused optimizers' ``found_inf``, the masked
update of the others, the first step that has no state yet), and the skips are counted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnchecker.recovery import GuardedOptimizer, guard

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=1e-2),  # no state at all: always "first"
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _backward(model: nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    model(torch.randn(4, 3, generator=g)).square().sum().backward()


def _state(opt: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)}
        for g in opt.param_groups
        for p in g["params"]
    ]


@pytest.mark.parametrize("name", OPTIMIZERS)
@settings(max_examples=8)
@given(flags=st.lists(st.booleans(), min_size=1, max_size=5))
def test_a_guarded_run_is_the_plain_run_without_the_flagged_steps(name, flags):
    if name == "sgd_fused":  # a flagged first step: see test_a_flagged_first_fused_sgd_step_...
        flags = [False, *flags]
    plain, guarded = _model(), _model()
    opt_plain = OPTIMIZERS[name](plain.parameters())
    opt = guard(OPTIMIZERS[name](guarded.parameters()), None)
    assert isinstance(opt, GuardedOptimizer) and opt.fused == ("fused" in name)
    for i, flagged in enumerate(flags):
        if not flagged:
            _backward(plain, i)
            opt_plain.step()
            opt_plain.zero_grad()
        _backward(guarded, i)
        opt.step(flag=torch.tensor(float(flagged)))
        opt.zero_grad()
    for a, b in zip(plain.parameters(), guarded.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_state(opt_plain), _state(opt.optimizer), strict=True):
        if not a:  # never stepped: a fused optimizer may have created its state, still fresh
            assert all(not v.any() for v in b.values()), b
            continue
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert float(opt.skipped) == sum(flags)


@pytest.mark.parametrize("name", ["adamw_fused", "sgd_momentum"])
def test_a_flagged_step_after_clean_ones_changes_nothing(name):
    model = _model()
    opt = guard(OPTIMIZERS[name](model.parameters()), None)
    for i in range(2):
        _backward(model, i)
        opt.step(flag=torch.tensor(0.0))
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state = _state(opt.optimizer)
    _backward(model, 2)
    opt.step(flag=torch.tensor(1.0))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    after = _state(opt.optimizer)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(state, after, strict=True) for k in a)
    assert float(opt.skipped) == 1.0
    assert not hasattr(opt.optimizer, "found_inf")  # the flag handed to a fused step is removed
    opt.step(flag=torch.tensor(0.0))  # the same gradients, unflagged: now the update happens
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


def test_the_guard_is_the_optimizer_for_everything_else():
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = guard(inner, None)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    _backward(model, 0)
    opt.step(flag=torch.tensor(0.0))
    saved = opt.state_dict()
    assert saved["state"] and saved == inner.state_dict()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    other = guard(torch.optim.AdamW(_model().parameters(), lr=1e-2), None)
    other.load_state_dict(saved)
    assert torch.equal(other.optimizer.state_dict()["state"][0]["exp_avg"],
                       saved["state"][0]["exp_avg"])  # fmt: skip


def test_a_flagged_first_fused_sgd_step_creates_no_momentum_buffer():
    """The first step creates the momentum buffer from the step's own gradient: a skipped first
    step must leave none (as the masked path does), or the next step starts from garbage."""
    model = _model()
    opt = guard(OPTIMIZERS["sgd_fused"](model.parameters()), None)
    _backward(model, 0)
    opt.step(flag=torch.tensor(1.0))
    assert not any(opt.optimizer.state[p] for p in model.parameters())


def test_the_finite_gradient_guard_skips_only_an_update_with_a_non_finite_gradient():
    """The reference without ABFT: a NaN or INF in one gradient skips the update (parameters
    and moments kept), a finite one goes through; the flag is computed without a host read."""
    from attnchecker.recovery.guard import FiniteGradients

    model = _model()
    opt = guard(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                FiniteGradients(model.parameters()))  # fmt: skip
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    kept = [p.detach().clone() for p in model.parameters()], _state(opt.optimizer)
    for bad in (float("nan"), float("inf")):
        _backward(model, 1)
        next(model.parameters()).grad[0, 0] = bad
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(kept[0], model.parameters(), strict=True))
        now = _state(opt.optimizer)
        assert all(torch.equal(v, s[k]) for s0, s in zip(kept[1], now, strict=True)
                   for k, v in s0.items())  # fmt: skip
    assert int(opt.skipped) == 2
    _backward(model, 2)
    opt.step()
    assert not torch.equal(kept[0][0], next(model.parameters())) and int(opt.skipped) == 2
