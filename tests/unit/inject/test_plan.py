"""Fault kinds edit exactly the requested elements; plans are reproducible and validated."""

from __future__ import annotations

import pytest
import torch

from attnchecker import ConfigError
from attnchecker.inject import Fault, FaultKind, FaultPattern, FaultPlan, apply_kind

SHAPES = [(5,), (6, 7), (2, 6, 7), (2, 3, 6, 7)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("pattern", list(FaultPattern))
@pytest.mark.parametrize(
    "kind", [FaultKind.NAN, FaultKind.INF, FaultKind.NEAR_INF, FaultKind.SCALE, FaultKind.BIT_FLIP]
)
def test_each_kind_edits_exactly_the_pattern(shape, pattern, kind):
    fault = Fault(step=1, site="scores", kind=kind, pattern=pattern, size=(2, 3), bit=0, value=3.0)
    t = torch.randn(shape) + 5  # away from zero: every kind changes every element it touches
    before = t.clone()
    index = fault.index(t.shape, torch.Generator().manual_seed(0))
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[index] = True
    old, _ = apply_kind(kind, t, index, bit=fault.bit, value=fault.value)
    changed = ~((t == before) | (t.isnan() & before.isnan()))
    assert torch.equal(changed, mask)
    assert torch.equal(old, before[index])
    M, N = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    block = min(2, M) * min(3, N)
    expected = {"0D": 1, "1R": N, "1C": M, "2D": block, "random": block}[pattern.value]
    assert int(mask.sum()) == expected


def test_given_coordinates_are_used():
    f = Fault(step=1, site="probs", pattern="2D", batch=1, head=2, row=4, col=5, size=(2, 2))
    assert f.index(torch.Size([2, 3, 6, 7]), torch.Generator()) == (1, 2, slice(4, 6), slice(5, 7))
    corner = Fault(step=1, site="probs", pattern="2D", row=5, col=6, size=(3, 3), batch=0, head=0)
    assert corner.index(torch.Size([1, 1, 6, 7]), torch.Generator()) == (
        0,
        0,
        slice(3, 6),
        slice(4, 7),
    )


def test_random_value_kind_is_seeded_and_finite():
    a = apply_kind(
        "random", torch.zeros(4), (slice(None),), generator=torch.Generator().manual_seed(1)
    )[1]
    b = apply_kind(
        "random", torch.zeros(4), (slice(None),), generator=torch.Generator().manual_seed(1)
    )[1]
    assert torch.equal(a, b) and torch.isfinite(a).all() and (a.abs() >= 1).all()


def test_plans_are_reproducible():
    kw = {
        "sites": ("q", "scores", "out"),
        "kinds": ("nan", "inf"),
        "patterns": ("0D", "2D"),
        "layers": (0, 1),
    }
    assert FaultPlan.sample(50, 3, **kw) == FaultPlan.sample(50, 3, **kw)
    assert FaultPlan.sample(50, 3, **kw) != FaultPlan.sample(50, 4, **kw)
    plan = FaultPlan.sample(20, 5, **kw)
    assert FaultPlan.from_json(plan.to_json()) == plan
    shape = torch.Size([2, 4, 16, 16])
    for i, f in enumerate(plan.faults):
        assert f.index(shape, plan.generator(i)) == f.index(shape, plan.generator(i))


def test_builder_carries_settings_over():
    plan = (
        FaultPlan.builder(seed=9)
        .at(3).site("scores", layer=1).kind("nan").pattern("1R").add()
        .site("v").add()
        .at(4).kind("bit_flip", bit=30).add(row=2)
        .build()
    )  # fmt: skip
    a, b, c = plan.faults
    assert (a.step, a.site, a.layer, a.kind, a.pattern) == (
        3,
        "scores",
        1,
        FaultKind.NAN,
        FaultPattern.R1,
    )
    assert (b.site, b.layer, b.kind) == ("v", 1, FaultKind.NAN)
    assert (c.step, c.kind, c.bit, c.row) == (4, FaultKind.BIT_FLIP, 30, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": 0, "site": "q"}, "from 1"),
        ({"step": 1, "site": "attention"}, "unknown site"),
        ({"step": 1, "site": "q", "kind": "bit_flip"}, "needs bit"),
        ({"step": 1, "site": "q", "kind": "melt"}, "melt"),
    ],
)
def test_bad_faults_are_refused(kwargs, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        Fault(**kwargs)


def test_kernel_sites_express_every_kind_or_refuse_it(monkeypatch):
    """Each fault kind has its own way into the kernels (no kind silently becomes near-INF);
    a kind without one is refused by name when the fault is made."""
    from attnchecker.errors import ConfigError
    from attnchecker.inject import kinds, plan
    from attnchecker.inject.kinds import KERNEL_MODES, FaultKind

    assert set(KERNEL_MODES) == set(FaultKind)
    Fault(step=1, site="kernel:s", kind="random")  # accepted
    table = {k: v for k, v in KERNEL_MODES.items() if k is not FaultKind.RANDOM}
    monkeypatch.setattr(kinds, "KERNEL_MODES", table)
    monkeypatch.setattr(plan, "KERNEL_MODES", table)
    with pytest.raises(ConfigError, match="cannot express fault kind random"):
        Fault(step=1, site="kernel:s", kind="random")
