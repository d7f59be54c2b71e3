"""Acceptance of the backward checks: a fault in any backward GEMM of protected attention (dQ,
dK, dP, dV and every projection's dX and dW) is detected, located and repaired in the same
backward pass, and the step's loss, every parameter gradient and the AdamW update equal the
fault-free step's (the tolerances of ``test_protect_faults``); every family of the table.

One protected model per family, its weights restored between faults (protecting is the slow
part); the reference is an unprotected copy.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

from attnchecker import ABFTConfig, kernels, protect_, unprotect_
from attnchecker.attention.config import ALL_OPS, GRAD_OPS, OPS
from attnchecker.models.families import FAMILIES

from .helpers import (
    KINDS,
    PATTERNS,
    batch,
    fire_once,
    max_diff,
    models,
    train_step,
    update_excess,
)

EXTREME = ("nan", "inf", "-inf", "1e10")


def _matrix(family, cases, *, config=None, layer=0, among=GRAD_OPS):
    """Run each (site, kind, pattern) once on one protected model (sites ``among`` those the
    family has); return the failures."""
    base, ref = models(family)
    inputs = batch(family)
    want = train_step(ref, inputs)
    handle = protect_(base, config or ABFTConfig())
    snapshot = copy.deepcopy(base.state_dict())
    sites = set(handle.state(handle.modules[0]).hooks) & set(among)
    failures, ran = [], 0
    for site, kind, pattern in cases:
        if site not in sites:
            continue
        base.load_state_dict(snapshot)
        base.zero_grad(set_to_none=True)
        hook = fire_once(site, pattern, kind, layer=layer)
        detach = handle.attach(hook, sites=[site])
        got = train_step(base, inputs)
        detach.remove()
        events = handle.drain()
        ran += 1
        ok = (
            bool(hook.fired)
            and torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
            and max_diff(got[1], want[1]) <= 1e-5
            and update_excess(got, want) <= 1e-5
            and any(e.op == site and e.action in ("corrected", "recomputed") for e in events)
            and not any(e.action == "uncorrectable" for e in events)
        )
        if not ok:
            failures.append((site, kind, pattern, bool(hook.fired), max_diff(got[1], want[1]),
                             [(e.op, e.action) for e in events]))  # fmt: skip
    unprotect_(base)
    return failures, ran, sites


@pytest.mark.parametrize("family", FAMILIES)
def test_every_backward_gemm_fault_is_corrected(family):
    """Every backward site the family has x every pattern, the extreme kinds taking turns."""
    kinds = itertools.cycle(EXTREME)
    cases = [(s, next(kinds), p) for s in GRAD_OPS for p in PATTERNS]
    failures, ran, sites = _matrix(family, cases)
    # the core's four and at least the fused or separate projections' dX and dW
    assert {"dq", "dk", "dp", "dv", "dx.q", "dw.q", "dx.out", "dw.out"} <= sites
    assert ran == 4 * len(sites)
    assert not failures, f"{len(failures)} of {ran}: {failures[:5]}"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_backward_fault_matrix_every_kind(family):
    """The whole kind x pattern matrix at one core and one projection GEMM of the backward."""
    cases = [(s, k, p) for s in ("dk", "dw.q") for k in KINDS for p in PATTERNS]
    failures, ran, _ = _matrix(family, cases)
    assert ran == len(cases)
    assert not failures, f"{len(failures)} of {ran}: {failures[:5]}"


def test_clean_protected_step_matches_the_plain_model_bitwise():
    """The backward runs the same ATen calls as autograd: on CPU the gradients are bitwise."""
    for family in ("gpt2", "llama", "bart"):
        base, ref = models(family)
        handle = protect_(base)
        got, want = train_step(base, batch(family)), train_step(ref, batch(family))
        assert handle.drain() == []
        assert all(torch.equal(got[1][n], want[1][n]) for n in want[1]), family


def test_unprotected_backward_dies_under_the_same_fault():
    """The control: the same fault in dK with the backward unchecked (ATTNChecker's coverage,
    the forward alone) poisons the gradients, unseen; with dK alone unchecked the check of the
    next GEMM (the K projection's dX, whose dY is now NaN) reports it uncorrectable."""
    for ops, seen in ((OPS, []), (tuple(o for o in ALL_OPS if o != "dk"), ["dw.k", "dx.k"])):
        model, _ = models("llama")
        handle = protect_(model, ABFTConfig(ops=ops, policy="warn"))
        assert "dk" in handle.state(handle.modules[0]).hooks  # the site stays, unchecked
        hook = fire_once("dk", "0D", "nan")
        handle.attach(hook, sites=["dk"])
        _, grads, _ = train_step(model, batch("llama"))
        assert hook.fired
        assert any(torch.isnan(g).any() for g in grads.values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            events = handle.drain()
        assert sorted(e.op for e in events if e.action == "uncorrectable") == seen


def test_fault_beyond_repair_is_uncorrectable_and_flags_the_step():
    """A block of dW wider than ``max_rows`` rows and spanning several columns cannot be
    rebuilt from row and column sums: reported uncorrectable, and ``found_inf`` says so."""
    model, _ = models("llama")
    handle = protect_(model, ABFTConfig(policy="warn", max_rows=1, check_impl="eager"))
    hook = fire_once("dw.q", "2D", "nan")
    handle.attach(hook, sites=["dw.q"])
    train_step(model, batch("llama"))
    assert float(handle.found_inf()) == 1.0
    with pytest.warns(RuntimeWarning, match="uncorrectable"):
        events = handle.drain()
    assert [e.action for e in events if e.op == "dw.q"] == ["uncorrectable"]
    assert float(handle.found_inf()) == 0.0


@pytest.mark.skipif(not kernels.available(), reason="needs triton (or its interpreter)")
def test_the_registered_ops_repair_a_block_beyond_the_eager_budget():
    """The same block with the GEMM checks' registered ops (``check_impl="triton"``): they
    recompute every flagged row (their repair runs on a flag only, so it has no budget), and
    the step equals the fault-free one."""
    model, ref = models("llama")
    inputs = batch("llama")
    want = train_step(ref, inputs)
    handle = protect_(model, ABFTConfig(policy="warn", max_rows=1, check_impl="triton"))
    handle.attach(fire_once("dw.q", "2D", "nan"), sites=["dw.q"])
    got = train_step(model, inputs)
    events = handle.drain()
    assert [e.action for e in events if e.op == "dw.q"] == ["recomputed"]
    assert torch.equal(got[0], want[0])
    assert max_diff(got[1], want[1]) <= 1e-5


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_backward_fault_under_bf16_autocast_is_corrected(impl):
    """Under autocast the checks see the bf16 operands the GEMMs multiplied; ``compiled``: as
    the default (``check_impl="auto"``) runs bf16 checks on a CPU, as compiled regions (the
    forward's q check too)."""
    base, ref = models("llama")
    inputs = batch("llama")
    handle = protect_(base, ABFTConfig(check_impl=impl))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # clean: no alarm
        train_step(base, inputs)
    assert handle.drain() == []
    base.load_state_dict(ref.state_dict())
    base.zero_grad(set_to_none=True)
    for site in ("dv", "dx.q", "q"):
        hook = fire_once(site, "1R", "inf")
        detach = handle.attach(hook, sites=[site])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = train_step(base, inputs)
            want = train_step(ref, inputs)
        detach.remove()
        events = handle.drain()
        assert hook.fired
        assert [e.action for e in events] == ["corrected"], events
        assert max_diff(got[1], want[1]) <= 1e-2
        base.load_state_dict(ref.state_dict())
