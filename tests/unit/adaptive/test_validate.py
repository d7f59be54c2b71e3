"""validate's statistics on hand-made profiles: the predictive interval is calibrated (counts
drawn from the model fall inside at its level), the binomial test, each row's verdicts and the
exit status, the naive baselines matched to a measured cost, the paired gains."""

from __future__ import annotations

import pytest
import torch

from attnchecker.adaptive.controller import FaultRate, choose, priced, sites
from attnchecker.adaptive.profile import Estimate
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


def test_the_predictive_interval_covers_counts_drawn_from_the_model_at_its_level():
    """Counts of a world whose cell rates are drawn from the same posteriors and whose events
    are Poisson: 90% intervals hold about 90% of them (a Poisson interval at the point rate,
    the old way, holds fewer when the trials are few)."""
    vuln, cost = _vuln(trials=6), _cost()
    rate, steps = FaultRate(0.01), 400
    pred = predict(vuln, cost, rate, (), steps, level=0.9, draws=4000, seed=1)
    g = torch.Generator().manual_seed(7)
    inside = 0
    n = 600
    for i in range(n):  # a world: one posterior draw of every cell, then a Poisson count
        world = predict(vuln, cost, rate, (), steps, level=0.9, draws=1, seed=100 + i)
        count = int(torch.poisson(torch.tensor([world.mean]), generator=g))
        inside += pred.low <= count <= pred.high
    assert 0.86 <= inside / n <= 0.97, (inside, n, pred)
    assert pred.low <= pred.mean <= pred.high


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
    assert _row([5] * 5, overhead=0.18).overhead_verdict == "ABOVE"  # within budget, not claim
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
    with pytest.raises(ConfigError, match="do not share"):
        priced(vuln, cost, rate, ((5, "scores", 1),), goal="x")
