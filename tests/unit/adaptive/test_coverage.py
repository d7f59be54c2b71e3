"""What one check covers of another site, from a campaign's check arms: the joint histogram of a
cell, the rate under a set of checks, the controller's knapsack with interactions, and the
predictive interval that draws the joint rates together."""

from __future__ import annotations

import pytest

from attnchecker.adaptive.controller import FaultRate, choose, risk_of
from attnchecker.adaptive.profile import (
    Cell,
    CostProfile,
    Estimate,
    OpCost,
    VulnerabilityProfile,
    relative,
    wilson,
)
from attnchecker.adaptive.validate import predict

OPS = ("scores", "probs", "context")
N = 40  # trials per cell, all non-trainable unprotected


def _cell(op: str, layer: int, saved_by: set[str]) -> Cell:
    """All N trials lost unprotected, saved alone by the checks ``saved_by`` of its layer."""
    arms = tuple(relative(o, 0) for o in OPS)
    lost = "|".join(sorted(["none", *(relative(o, 0) for o in OPS if o not in saved_by)]))
    return Cell(op, layer, "nan", N, {"non_trainable": N}, {"masked": N}, arms, {lost: N})


def _vuln(context_covers: bool = True) -> VulnerabilityProfile:
    """A fault in scores or probs is lost unless its own check runs or (``context_covers``) the
    context check, whose repair recomputes them; a fault in context only its own check saves."""
    cells = []
    for layer in (0, 1):
        for op in ("scores", "probs"):
            cells.append(_cell(op, layer, {op, "context"} if context_covers else {op}))
        cells.append(_cell("context", layer, {"context"}))
    return VulnerabilityProfile("gpt2", {"size": "tiny"}, tuple(cells))


def _cost() -> CostProfile:
    costs = {"scores": 0.10, "probs": 0.10, "context": 0.12}  # all layers
    return CostProfile(
        "gpt2", {"layers": 2}, 0.01, Estimate(0.0, 0.0, 0.0), 10,
        tuple(OpCost(op, Estimate(c, c, c), 100) for op, c in costs.items()),
        tuple((layer, op, 1000) for layer in (0, 1) for op in OPS), step_macs=3000,
    )  # fmt: skip


def test_a_trial_survives_a_set_of_checks_when_one_of_them_saved_it_alone():
    s, p, c, d = (relative(op, 0) for op in ("scores", "probs", "context", "dk"))
    before = relative("dk", -1)  # the dk check one layer before the fault's
    joint = {f"none|{p}": 5, f"none|{before}|{c}|{p}": 3, "": 2}
    cell = Cell("scores", 1, "nan", 10, {"non_trainable": 8}, {}, (s, p, c, before), joint)
    rate = lambda *on: cell.rate_with(frozenset(on)).point
    assert rate() == 0.8  # the unprotected arm: 8 of 10 lost
    assert rate(s) == 0.0  # its own check saved all 8
    assert rate(c) == 0.3 and rate(p) == 0.8 and rate(before) == 0.3
    assert rate(p, c) == 0.3  # lost in both arms: 3
    assert rate(c, d) == 0.3  # a check without an arm is not credited
    old = Cell("scores", 0, "nan", 10, {"non_trainable": 8}, {"non_trainable": 1})
    assert old.rate_with(frozenset({c})).point == 0.8  # no check arms: own site only
    assert old.rate_with(frozenset({s, c})).point == 0.1


def test_pooled_layers_judge_an_arm_on_the_layers_that_ran_it():
    """dk one layer before saves the faults of layer 1; layer 0 has no layer before, so its
    trials say nothing of that arm: pooled, the rate under it is that of layer 1's 4 trials (0,
    with 4 trials' interval), not diluted by layer 0's; when no layer ran every arm asked for,
    each trial is judged on the arms its layer ran."""
    dk, here, after = relative("dk", -1), relative("scores", 0), relative("dk", 1)
    lost = {"non_trainable": 4}
    cells = (Cell("scores", 0, "nan", 4, lost, {}, (here, after), {f"none|{here}": 4}),
             Cell("scores", 1, "nan", 4, lost, {}, (here, dk), {f"none|{here}": 4}))  # fmt: skip
    pooled = VulnerabilityProfile("gpt2", {}, cells).pooled().cells[0]
    assert pooled.checks == (dk, here, after) and pooled.trials == 8
    assert pooled.rate_with(frozenset({dk})) == wilson(0, 4)
    assert pooled.rate_with(frozenset({here})) == wilson(8, 8)
    assert pooled.rate_with(frozenset({dk, after})) == wilson(0, 8)  # each on its own arm
    assert pooled.rate_with(frozenset({dk, here})) == wilson(0, 4)


def test_the_controller_buys_the_check_that_covers_most():
    """One check per layer fits every step: with the context check covering scores and probs
    it is the best buy (three sites for 0.06); credited with its own site only it is the worst
    (one site for 0.06 against 0.05), as the old model had it."""
    rate = FaultRate(1.0)
    covers = choose(_vuln(), _cost(), rate, budget=0.125)
    assert covers.checks == ((0, "context", 1), (1, "context", 1))
    assert covers.risk.point == 0  # every fault of both layers saved
    own_only = choose(_vuln(context_covers=False), _cost(), rate, budget=0.125)
    every_step = {op for _, op, k in own_only.checks if k == 1}
    assert "context" not in every_step and own_only.risk.point > 0.3 * own_only.unprotected.point


def test_a_check_adds_nothing_where_another_already_covers_its_site():
    vuln, cost, rate = _vuln(), _cost(), FaultRate(1.0)
    context = tuple((layer, "context", 1) for layer in (0, 1))
    both = (*context, *((layer, "scores", 1) for layer in (0, 1)))
    assert risk_of(vuln, cost, rate, both) == risk_of(vuln, cost, rate, context)
    full = choose(vuln, cost, rate, budget=1.0)  # the knapsack stops where nothing is left
    assert {op for _, op, _ in full.checks} == {"context"}


def test_periodic_checks_cover_on_their_steps_only():
    """Context every 2 steps and scores every step: a scores fault is always saved, a probs
    fault half the time, a context fault half the time."""
    vuln, cost, rate = _vuln(), _cost(), FaultRate(1.0)
    checks = ((0, "scores", 1), (0, "context", 2))
    unprotected = risk_of(vuln, cost, rate, ())
    risk = risk_of(vuln, cost, rate, checks)
    per_site = unprotected.point / 6
    assert risk.point == pytest.approx(per_site * (3 + 0.5 + 0.5))  # layer 1: 3 sites lost


def test_the_predictive_interval_follows_the_joint_rates():
    vuln, cost, rate = _vuln(), _cost(), FaultRate(0.01)
    context = tuple((layer, "context", 1) for layer in (0, 1))
    none = predict(vuln, cost, rate, (), 1000)
    covered = predict(vuln, cost, rate, context, 1000)
    # 0.02 faults per step on 6 sites; lost: 40 of 40 trials, + 0.5 for the unseen category
    # "lost under any check", of 40 + 3 x 0.5 (Jeffreys, three categories)
    assert none.mean == pytest.approx(1000 * 0.02 * 41 / 41.5, rel=0.05)
    assert covered.mean < none.mean / 20 and covered.high <= 2
    half = predict(vuln, cost, rate, tuple((layer, "context", 2) for layer in (0, 1)), 1000)
    assert half.mean == pytest.approx(none.mean / 2, rel=0.1)
