"""validate's statistics on hand-made profiles: the predictive interval is calibrated (counts
of a world with fixed true rates fall inside at its level), the binomial test, each row's
verdicts and the exit status, the naive baselines matched to a measured cost, the paired
gains."""

from __future__ import annotations

import pytest
import torch

from attnchecker.adaptive.controller import FaultRate, choose, priced, sites
from attnchecker.adaptive.profile import Cell, Estimate, VulnerabilityProfile
from attnchecker.adaptive.simulate import Condition, Run
from attnchecker.adaptive.validate import (
    Gain,
    Prediction,
    Row,
    Validation,
    baselines,
    binomial_miss,
    ladders,
    matched,
    predict,
)
from attnchecker.errors import ConfigError

from .test_controller import _cost, _vuln

THETA = {"scores": 0.6, "context": 0.3, "dk": 0.1}  # the world's true non-trainable rates


def _profile(trials: int, fatal: dict) -> VulnerabilityProfile:
    """A profile whose cell ``(op, layer, kind)`` saw ``fatal[cell]`` of ``trials`` unprotected
    faults end non-trainable."""
    return VulnerabilityProfile("gpt2", {"size": "tiny"}, tuple(
        Cell(op, layer, kind, trials, {"non_trainable": k, "masked": trials - k},
             {"non_trainable": 0, "masked": trials})
        for (op, layer, kind), k in fatal.items()))  # fmt: skip


def test_the_predictive_interval_is_calibrated_against_a_world_of_fixed_true_rates():
    """An independent generator, not the model's own draws: a world with fixed true rates
    (``THETA``); each repetition runs a campaign of 6 trials a cell (binomial counts), predicts
    from it, and draws the run's count from the true rates (Poisson at the true mean, ~40
    events). The 90% intervals hold 85-96% of the counts; a Poisson interval at the campaign's
    point rates (the posterior's uncertainty dropped) holds clearly fewer, and so does a
    posterior made 20x overconfident (measured: 89-92%; the point interval 78-82%; the 20x
    posterior 80%)."""
    cost, rate, steps, trials, big = _cost(), FaultRate(0.5), 400, 6, 10**6
    cells = [(op, layer, kind) for op in THETA for layer in (0, 1) for kind in ("nan", "inf")]
    exact = _profile(big, {c: int(THETA[c[0]] * big) for c in cells})
    truth = predict(exact, cost, rate, (), steps, draws=100).mean  # the posterior at the truth
    assert truth == pytest.approx(40, rel=1e-3)
    g = torch.Generator().manual_seed(4)
    n, model, point = 400, 0, 0
    for i in range(n):
        fatal = {c: int(torch.binomial(torch.tensor(float(trials)), torch.tensor(THETA[c[0]]),
                                       generator=g)) for c in cells}  # fmt: skip
        pred = predict(_profile(trials, fatal), cost, rate, (), steps, draws=2000, seed=i)
        at_point = predict(_profile(trials * big, {c: k * big for c, k in fatal.items()}),
                           cost, rate, (), steps, draws=2000, seed=i)  # fmt: skip
        count = int(torch.poisson(torch.tensor([truth]), generator=g))
        model += pred.low <= count <= pred.high
        point += at_point.low <= count <= at_point.high
    assert 0.85 <= model / n <= 0.96, (model, point, n)
    assert point / n <= 0.85 and point < model - 0.05 * n, (model, point, n)


def test_checking_removes_the_predicted_events_and_a_level_widens_the_interval():
    vuln, cost = _vuln(), _cost()
    rate = FaultRate(0.01)
    full = choose(vuln, cost, rate, budget=10.0)
    none, checked = (predict(vuln, cost, rate, c, 1000) for c in ((), full.checks))
    assert checked.mean < none.mean / 20 and checked.high <= 2
    wide = predict(vuln, cost, rate, (), 1000, level=0.99)
    assert wide.low <= none.low and wide.high >= none.high and wide.high > none.high


def test_the_binomial_test_at_five_percent():
    assert not binomial_miss(3, 5, 0.9)  # P(X <= 3) = 0.081
    assert binomial_miss(2, 5, 0.9)  # 0.0086
    assert not binomial_miss(0, 0, 0.9)
    assert binomial_miss(20, 30, 0.9) and not binomial_miss(25, 30, 0.9)


def _row(events, *, low=2, high=8, overhead=0.1, budget=0.2, checks=((0, "scores", 1),),
         judged=True) -> Row:  # fmt: skip
    runs = tuple(Run(i, 20, e, 0) for i, e in enumerate(events))
    return Row("r", "in-sample", budget, checks, Condition(judged=judged), 100, runs,
               Prediction(5.0, low, high, 0.9), Estimate(overhead, overhead - 0.02,
               overhead + 0.02), Estimate(0.1, 0.05, 0.15), 1.0)  # fmt: skip


def test_row_verdicts_and_the_exit_status():
    assert _row([3, 5, 7, 9, 4]).count_verdict == "inside"  # one miss of five: chance
    above = _row([9, 12, 15, 5, 20])
    assert above.count_verdict == "ABOVE"
    below = _row([0, 1, 0, 5, 1])
    assert below.count_verdict == "BELOW"
    assert _row([5] * 5, overhead=0.25).overhead_verdict == "OVER BUDGET"
    assert _row([5] * 5, overhead=0.17).overhead_verdict == "ABOVE"  # within budget, not claim
    # the budget judged by the measurement's upper end, as plan --verify fits it: a point
    # within the budget whose upper end is not broke the contract
    assert _row([5] * 5, overhead=0.19).overhead_verdict == "OVER BUDGET"
    assert "+19.0% [+17.0%, +21.0%] OVER BUDGET (budget 20%, upper end)" in _row(
        [5] * 5, overhead=0.19).misses()[0]  # fmt: skip
    assert _row([5] * 5, overhead=0.01).overhead_verdict == "BELOW"
    assert _row([5] * 5, overhead=0.25, budget=None).overhead_verdict == "ABOVE"
    ok = _row([5] * 5)
    assert Validation((ok,), (), 0.9).status == 0
    assert Validation((ok, above), (), 0.9).status == 1
    assert Validation((ok, below), (), 0.9).status == 3  # wrong on the safe side: still wrong
    assert Validation((ok, _row([5] * 5, overhead=0.25)), (), 0.9).status == 1
    assert Validation((ok, _row([20] * 5, judged=False)), (), 0.9).status == 0  # reported only
    # many rows each just inside their test can still fail pooled: 3 of 5 inside, ten times
    rows = tuple(_row([5, 5, 5, 20, 20]) for _ in range(10))
    assert all(r.count_verdict == "inside" for r in rows)
    val = Validation(rows, (), 0.9)
    assert val.coverage() == (30, 50) and val.status == 1 and "pooled" in val.misses()[0]
    assert Validation.from_dict(val.to_dict()) == val


def test_the_baselines_are_the_dearest_of_each_kind_whose_measured_cost_fits():
    """A "measurement" here: the cost model's point sum plus a fixed 2% per check (costs that
    do not add up); the bisection finds, in a few measurements, the same rung as a walk along
    the whole ladder, and a kind that cannot get that cheap is left out with a note."""
    vuln, cost = _vuln(), _cost()
    rate = FaultRate(1.0)
    points = {(s.layer, s.op): s.cost.point for s in sites(vuln, cost, rate)}
    calls = []

    def measure(checks):
        calls.append(checks)
        return sum(points[(layer, op)] / k + 0.02 for layer, op, k in checks)

    kinds = ladders(vuln, cost, rate)
    assert list(kinds) == ["every check", "forward only", "random subset"]
    every, forward, subset = kinds.values()
    assert [len(c) for _, c in every] == [6] * 7 and every[-1][0] == "every check"
    assert [c[0][2] for _, c in every] == [64, 32, 16, 8, 4, 2, 1]  # cheapest first
    assert {op for _, c in forward for _, op, _ in c} == {"scores", "context"}
    assert [len(c) for _, c in subset] == [1, 2, 3, 4, 5, 6]
    for target in (0.05, 0.3, 10.0):
        for ladder in kinds.values():
            calls.clear()
            i, seen = matched(ladder, measure, target)
            fits = [j for j, (_, c) in enumerate(ladder) if measure(c) <= target]
            assert i == (max(fits) if fits else -1)
            assert len(seen) <= len(ladder).bit_length()  # bisection, not a walk
    found, notes = baselines(vuln, cost, rate, 0.3, measure)
    assert {n.split(" (")[0] for n, _ in found} == {"every check", "forward only", "random subset"}
    for _, choice in found:
        assert measure(choice.checks) <= 0.3 and choice.checks
    found, notes = baselines(vuln, cost, rate, 1e-4, measure)  # below every cheapest rung
    assert not found and len(notes) == 3 and "above the controller's" in notes[0]
    gain = Gain("every check", (3, 5, 4))
    assert gain.mean.point == 4 and gain.mean.low < 4 < gain.mean.high
    assert Gain("x", (2, 2, 2)).mean == Estimate(2, 2, 2)
    # Student's t with 4 degrees of freedom for 5 seeds (2.776), not the normal's 1.96:
    # mean 3, sd sqrt(2.5), half-width 2.776 sqrt(2.5) / sqrt(5) = 1.963
    assert Gain("x", (1, 2, 3, 4, 5)).mean == pytest.approx(Estimate(3, 3 - 1.963, 3 + 1.963),
                                                            abs=1e-3)  # fmt: skip
    with pytest.raises(ConfigError, match="do not share"):
        priced(vuln, cost, rate, ((5, "scores", 1),), goal="x")
