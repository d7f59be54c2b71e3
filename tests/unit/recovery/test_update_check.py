"""The optimizer update's check (recovery/update_check.py, through attnchecker.guard): a fault in
the optimizer state or the parameters, before or after the update, extreme or small, is
corrected in its step (the run then equals the fault-free run), for AdamW (fused, foreach,
for-loop), Adam with L2 decay and SGD with momentum; a clean run raises nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attnchecker import guard
from attnchecker.abft.update import as_rows
from attnchecker.inject.injector import Injector
from attnchecker.inject.plan import Fault, FaultPlan
from attnchecker.recovery.guard import FiniteGradients

OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-for-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
    "adam-l2": lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}
STATE = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}
KINDS = [("inf", None), ("nan", None), ("scale", 16.0), ("scale", 1 + 2**-4)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))


def _run(name: str, plan: FaultPlan | None = None, steps: int = 4, dtype=torch.float32):
    model = _model().to(dtype)
    opt = guard(OPTIMIZERS[name](model.parameters()), FiniteGradients(model.parameters()),
                check_update=True, names=model)  # fmt: skip
    events = []
    g = torch.Generator().manual_seed(1)
    with Injector(model, plan or FaultPlan([]), optimizer=opt.optimizer):
        for _ in range(steps):
            x = torch.randn(32, 64, generator=g).to(dtype)
            model(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            events += opt.settle()
    return model, events


def _sites(name: str) -> list[str]:
    keys = ["param", *STATE["adam" if name.startswith("adam") else "sgd"]]
    return [f"optim:0.weight:{k}{w}" for k in keys for w in ("", ":written")]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_every_single_element_fault_is_corrected_in_its_step(name):
    clean, events = _run(name)
    assert events == []
    kinds = KINDS if name == "adamw" else [KINDS[1], KINDS[3]]  # the others: NaN and small
    for site in _sites(name):
        for kind, value in kinds:
            plan = FaultPlan([Fault(step=3, site=site, kind=kind, value=value, row=3, col=5)])
            faulty, events = _run(name, plan)
            assert events and all(e["action"] == "corrected" for e in events), (site, kind, events)
            assert {e["step"] for e in events} == {-1}
            for a, b in zip(clean.parameters(), faulty.parameters(), strict=True):
                # the repaired element is the row's predicted sum less the others, in float64:
                # within the check's own tolerance, 4 u of the row's L1 norm, twice over (the
                # kept sums and the new ones)
                bound = 8 * 2**-24 * float(as_rows(a.detach()).abs().sum(1).max())
                assert float((a - b).abs().max()) <= bound, (site, kind)


def test_a_skipped_step_is_not_a_false_alarm_and_its_update_is_checked_against_no_change():
    model = _model()
    params = FiniteGradients(model.parameters())
    opt = guard(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), params,
                check_update=True)  # fmt: skip
    for step in range(3):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("nan")  # the guard skips this step
        opt.step()
        opt.zero_grad()
        assert opt.settle() == []
    assert float(opt.skipped) == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_false_alarm_over_clean_steps(dtype):
    for name in OPTIMIZERS:
        _, events = _run(name, steps=15, dtype=dtype)
        assert events == [], (name, dtype)


def test_what_is_not_covered_is_named():
    from attnchecker.recovery.update_check import covered

    assert covered(torch.optim.Adam([nn.Parameter(torch.ones(2))], amsgrad=True))[0] is None
    rule, why = covered(torch.optim.RMSprop([nn.Parameter(torch.ones(2))]))
    assert rule is None and "RMSprop" in why
