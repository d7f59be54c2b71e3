"""Acceptance: for every family, op, fault kind and pattern, the protected training step's loss,
every parameter gradient and the parameters after an AdamW step equal the fault-free step's.

Tolerance (fp32): a repaired value is recomputed by a smaller GEMM than the original, so it may
differ in the last bits; loss within 1e-6 relative, gradients within 1e-5 absolute, updated
parameters within 1e-5 beyond what AdamW itself makes of the gradient difference (its first step
divides by |g| + eps, so near |g| ~ eps a last-bit gradient difference moves an update by up to
lr |dg| / eps: ``helpers.update_excess``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.attention.config import OPS
from attnchecker.models.families import FAMILIES

from .helpers import (
    KINDS,
    PATTERNS,
    SITES,
    batch,
    fault_list,
    fault_matrix,
    fire_once,
    models,
    train_step,
)


def _faulty_step(base, inputs, site, kind, pattern, layer=0, mode="naive"):
    model = copy.deepcopy(base)
    handle = protect_(model, ABFTConfig(mode=mode))
    hook = fire_once(site, pattern, kind, layer=layer)
    handle.attach(hook)
    result = train_step(model, inputs)
    assert hook.fired, "the fault never fired"
    return result, handle.drain()


# The default run: per family every (site, pattern) once, the kinds taking turns from the
# family's index on (helpers.fault_matrix's ``rotate``), so the families together run every
# (site, kind, pattern) triple and each kind meets every family; the whole cross product per
# family (168 faulty steps) in the slow set, with passing mode on BERT (llama's covers it).
SLOW = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize(
    ("family", "mode", "full"),
    [(f, "naive", False) for f in FAMILIES]
    + [("llama", "passing", False)]
    + [pytest.param(f, "naive", True, marks=SLOW) for f in FAMILIES]
    + [pytest.param(f, "passing", True, marks=SLOW) for f in ("bert", "llama")],
)  # fmt: skip
def test_every_fault_is_corrected(family, mode, full):
    # the forward's faults with the forward's checks (the backward's checks have their own
    # matrix in test_protect_backward; forward faults under the default config: DDP, Trainer,
    # compile, usage tests)
    base, _ = models(family)
    rotate = None if full else list(FAMILIES).index(family)
    config = ABFTConfig(mode=mode, ops=OPS)
    failures = fault_matrix(base, batch(family), train_step, config=config, rotate=rotate)
    n = len(SITES) * len(PATTERNS) * (len(KINDS) if full else 1)
    assert not failures, f"{len(failures)} of {n}: {failures[:5]}"


def test_the_default_run_covers_every_fault_triple():
    """What the rotation promises: over the families of the default run, every (site, kind,
    pattern) triple runs at least once."""
    ran = {f for r in range(len(FAMILIES)) for f in fault_list(rotate=r)}
    assert ran == set(fault_list())
    assert all(len(fault_list(rotate=r)) == len(SITES) * len(PATTERNS) for r in range(3))


@pytest.mark.parametrize(
    ("site", "pattern", "expected"),
    [
        ("scores", "0D", "0D"),
        ("q", "1R", "1R"),
        ("v", "1C", "1C"),
        ("context", "2D", "2D"),
        ("out", "2D", "2D"),
    ],
)
def test_events_describe_the_fault(site, pattern, expected):
    base, _ = models("bert")
    _, events = _faulty_step(base, batch("bert"), site, "nan", pattern)
    [event] = [e for e in events if e.op == site]
    assert event.pattern == expected
    assert event.kind == "nan"
    assert event.action == ("recomputed" if expected == "2D" else "corrected")
    assert event.layer == 0 and event.step == 1 and not event.replay


def test_unprotected_model_dies_under_the_same_fault():
    """The control: the same fault through the same site, with checks off, makes the loss NaN."""
    model, _ = models("gpt2")
    handle = protect_(model, ABFTConfig(ops=()))

    def fault(call):
        if call.site == "scores" and call.layer == 0:
            call.tensor[0, 0, 3, 1] = float("nan")

    handle.attach(fault)
    loss, _, _ = train_step(model, batch("gpt2"))
    assert torch.isnan(loss)
    assert handle.drain() == []
