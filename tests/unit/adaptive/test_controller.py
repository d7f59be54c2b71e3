"""The controller's math on hand-made profiles: the knapsack under a budget or a target, the
edge cases (zero rate, a budget below the cheapest check, an unreachable target), intervals, and
the schedules it hands to ABFTConfig."""

from __future__ import annotations

import pytest

from attnchecker.adaptive.bench import median_interval
from attnchecker.adaptive.controller import FaultRate, choose, fit_measured, risk_of, sites
from attnchecker.adaptive.profile import (
    Cell,
    CostProfile,
    Estimate,
    OpCost,
    VulnerabilityProfile,
    wilson,
)
from attnchecker.adaptive.simulate import count_interval
from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import ConfigError

OPS = ("scores", "context", "dk")


def _vuln(trials: int = 50, fatal: dict | None = None) -> VulnerabilityProfile:
    fatal = fatal or {"scores": 50, "context": 25, "dk": 5}  # of 50 unprotected faults
    cells = []
    for op in OPS:
        for layer in (0, 1):
            for kind in ("nan", "inf"):
                k = fatal[op] * trials // 50
                cells.append(Cell(op, layer, kind, trials,
                                  {"non_trainable": k, "masked": trials - k},
                                  {"non_trainable": 0, "masked": trials}))  # fmt: skip
    return VulnerabilityProfile("gpt2", {"size": "tiny"}, tuple(cells))


def _cost(engine: float = 0.05) -> CostProfile:
    costs = {"scores": 0.10, "context": 0.10, "dk": 0.02}  # all layers
    return CostProfile(
        "gpt2", {"layers": 2}, 0.01, Estimate(engine, engine * 0.5, engine * 1.5), 10,
        tuple(OpCost(op, Estimate(c, c * 0.8, c * 1.2), 100) for op, c in costs.items()),
        tuple((layer, op, 1000) for layer in (0, 1) for op in OPS), step_macs=10_000,
    )  # fmt: skip


def test_wilson_interval_contains_the_rate_and_is_sensible_at_zero():
    e = wilson(0, 20)
    assert e.point == 0 and e.low == 0 and 0.1 < e.high < 0.2
    e = wilson(20, 20)
    assert e.point == 1 and e.high == 1 and 0.8 < e.low < 0.9
    e = wilson(5, 20)
    assert e.low < 0.25 < e.high
    assert wilson(50, 200).high - wilson(50, 200).low < e.high - e.low  # more trials: tighter


def test_median_and_poisson_intervals():
    e = median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 9.0, 0.0])
    assert e.point == 3.0 and e.low <= 1.0 and e.high >= 5.0
    assert count_interval(0)[1] == pytest.approx(3.689, abs=1e-3)  # the exact 95% bounds
    assert count_interval(10) == pytest.approx((4.795, 18.390), abs=1e-3)


def test_exposure_follows_the_rate_unit():
    vuln, cost = _vuln(), _cost()
    per_op = sites(vuln, cost, FaultRate(1e-4, "element-op"))
    assert {s.faults for s in per_op} == {1e-4 * 1000}
    per_step = sites(vuln, cost, FaultRate(1.0, "step"))
    assert {s.faults for s in per_step} == {1000 / 10_000}  # by share of the step's work
    hourly = sites(vuln, cost, FaultRate(3600.0, "device-hour"))  # one per second, 0.01 s steps
    assert {round(s.faults, 12) for s in hourly} == {0.01 * 1000 / 10_000}


def test_a_larger_budget_never_leaves_more_risk_and_stays_within_it():
    vuln, cost = _vuln(), _cost()
    rate = FaultRate(1.0)
    risks = []
    for budget in (0.08, 0.1, 0.15, 0.3, 1.0):
        c = choose(vuln, cost, rate, budget=budget)
        assert c.overhead.high <= budget + 1e-12  # the contract: the cost's upper end fits
        risks.append(c.risk.high)
        ABFTConfig.from_dict(c.config.to_dict())  # what protect_ accepts, round trip
    assert risks == sorted(risks, reverse=True) and risks[-1] < risks[0]
    full = choose(vuln, cost, rate, budget=1.0)
    assert len(full.checks) == 6 and full.risk.point == 0
    # per layer: scores removes 1.0 of risk per fault for 0.05, dk 0.1 for 0.01, context 0.5
    # for 0.05: the scores of one layer is the best buy; at the upper ends (engine 7.5%, scores
    # 6% per layer) it takes 13.5%, and a point-cost decision would have taken it at 10%
    first = choose(vuln, cost, rate, budget=0.1351)
    assert [(op, every) for _, op, every in first.checks] == [("scores", 1)]
    at_10 = choose(vuln, cost, rate, budget=0.10).checks
    assert ("scores", 1) not in {(op, every) for _, op, every in at_10}


def test_the_choice_carries_its_config():
    vuln, cost = _vuln(), _cost()
    choice = choose(vuln, cost, FaultRate(1.0), budget=0.3)
    assert isinstance(choice.config, ABFTConfig) and choice.config.schedule
    assert risk_of(vuln, cost, FaultRate(1.0), choice.checks) == choice.risk
    assert risk_of(vuln, cost, FaultRate(1.0), ()) == choice.unprotected


def test_periodic_checks_fill_a_budget_between_whole_checks():
    vuln, cost = _vuln(), _cost()
    c = choose(vuln, cost, FaultRate(1.0), budget=0.05 + 0.02 + 0.05 / 4)
    everies = {every for *_, every in c.checks}
    assert everies - {1}, c.checks  # something every k steps
    assert c.config.period in (2, 4, 8, 16, 32, 64)


def test_target_is_met_at_the_high_end_and_cheaper_targets_cost_less():
    vuln, cost = _vuln(), _cost()
    rate = FaultRate(1.0)
    ends = choose(vuln, cost, rate, budget=1.0)
    none, full = ends.unprotected, ends.full  # full.high: 0 of 50 protected failures' bound
    costs = []
    for frac in (0.8, 0.5, 0.1):
        target = full.high + frac * (none.high - full.high)
        c = choose(vuln, cost, rate, target=target)
        assert c.risk.high <= target * (1 + 1e-9)
        costs.append(c.overhead.point)
    assert costs == sorted(costs)
    assert choose(vuln, cost, rate, target=none.high * 2).checks == ()  # met unprotected


def test_edge_cases_say_what_is_wrong():
    vuln, cost = _vuln(), _cost()
    zero = choose(vuln, cost, FaultRate(0.0), budget=0.5)
    assert zero.checks == () and zero.risk.high == 0 and zero.overhead.point == 0
    assert any("fault rate 0" in n for n in zero.notes)
    assert choose(vuln, cost, FaultRate(0.0), target=0.0).checks == ()
    with pytest.raises(ConfigError, match="below the cheapest check"):
        choose(vuln, cost, FaultRate(1.0), budget=0.01)
    few = _vuln(trials=5)  # 0 of 5 protected failures: the upper bound stays high
    with pytest.raises(ConfigError, match="no schedule meets"):
        choose(few, cost, FaultRate(1.0), target=1.0)
    with pytest.raises(ConfigError, match="not both"):
        choose(vuln, cost, FaultRate(1.0), target=1.0, budget=0.1)
    with pytest.raises(ConfigError, match="per step"):
        FaultRate(1.0, "fortnight")
    with pytest.raises(ConfigError, match="not measured"):
        choose(vuln, cost, FaultRate(1.0, kinds={"exponent_flip": 1.0}), budget=0.5)


def test_unprofiled_ops_are_left_out_and_named():
    vuln = VulnerabilityProfile("gpt2", {}, tuple(c for c in _vuln().cells if c.op != "dk"))
    c = choose(vuln, _cost(), FaultRate(1.0), budget=1.0)
    assert "dk" not in {op for _, op, _ in c.checks}
    assert any("dk" in n for n in c.notes) and c.coverage == pytest.approx(0.4)


def test_pooling_layers_merges_their_trials():
    vuln = _vuln(trials=10)
    pooled = vuln.pooled()
    assert len(pooled.cells) == len(vuln.cells) // 2 and {c.trials for c in pooled.cells} == {20}
    cell, extrapolated = pooled.cell("scores", 1, "nan")
    assert cell.trials == 20 and not extrapolated
    wide, tight = vuln.cell("dk", 0, "nan")[0].rate(), cell.rate()
    assert tight.high - tight.low < wide.high - wide.low or cell.rate().point in (0, 1)
    ss = sites(pooled, _cost(), FaultRate(1.0))
    assert len(ss) == 6 and not any(s.note for s in ss)


def test_profiles_round_trip_and_refuse_other_versions(tmp_path):
    vuln, cost = _vuln(), _cost()
    assert VulnerabilityProfile.load(vuln.save(tmp_path / "v.json")) == vuln
    assert CostProfile.load(cost.save(tmp_path / "c.json")) == cost
    (tmp_path / "old.json").write_text('{"version": 0}')
    with pytest.raises(ConfigError, match="version"):
        CostProfile.load(tmp_path / "old.json")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(schedule=((0, "scores", 2), (0, "dk", 4))), "one period"),
        (dict(schedule=((0, "scores", 1), (0, "scores", 2))), "twice"),
        (dict(schedule=((0, "nope", 1),)), "unknown op"),
        (dict(schedule=((0, "dk", 0),)), "every"),
        (dict(schedule=((0, "dk", 1),), layers=(0,)), "not both"),
        (dict(schedule=((0, "mlp.c_fc:y", 1),)), "use scope='all_linear'"),
    ],
)
def test_bad_schedules_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ABFTConfig(**kwargs)


def test_schedule_ops_per_layer_and_step():
    cfg = ABFTConfig(schedule=((1, "dk", 1), (0, "scores", 4), (0, "context", 1)))
    assert cfg.period == 4 and cfg.schedule[0] == (0, "scores", 4)
    assert cfg.layer_ops(0, step=1) == {"scores", "context"}
    assert cfg.layer_ops(0, step=2) == {"context"} and cfg.layer_ops(0, step=5) == {
        "scores", "context"}  # fmt: skip
    assert cfg.layer_ops(2) == frozenset()
    with pytest.raises(ConfigError, match="unknown ABFTConfig fields"):
        ABFTConfig.from_dict({"opps": []})


def test_a_plan_pins_the_engine_it_was_priced_for(tmp_path):
    """The cost profile prices the checked eager engine's ops, so a plan's config runs there:
    its backend is "eager", and asking for the fused kernels is refused by name."""
    from attnchecker.adaptive.controller import load_plan, save_plan

    choice = choose(_vuln(), _cost(), FaultRate(1.0), budget=0.3)
    assert choice.config.backend == "eager"
    path = save_plan(choice, FaultRate(1.0), tmp_path / "plan.json")
    assert load_plan(path) == choice.config == load_plan(path, backend="eager")
    for other in ("triton", "auto"):
        with pytest.raises(ConfigError, match="priced for the eager engine"):
            load_plan(path, backend=other)


def test_a_measured_fit_backs_off_until_the_measured_overhead_is_within_the_budget():
    """A machine where every schedule costs half again what the cost model adds up (as many
    checks did on the CPU): the first choice at 30% measures over it, the next one, chosen
    within the budget scaled by 30 / measured, fits; the choice carries its measurement; a
    budget nothing fits by measurement is refused with the tries named."""
    vuln, cost = _vuln(), _cost()
    rate = FaultRate(1.0)
    points = {(s.layer, s.op): s.cost.high for s in sites(vuln, cost, rate)}
    measured = []

    def measure(choice):  # +50% over the additive model's upper end
        m = 1.5 * (cost.engine.high + sum(points[(la, op)] / k for la, op, k in choice.checks))
        measured.append(m)
        return Estimate(m, 0.9 * m, m)

    first = choose(vuln, cost, rate, budget=0.3)
    assert first.overhead.high <= 0.3 < measure(first).high  # predicted fits, measured not
    measured.clear()
    fit = fit_measured(vuln, cost, rate, 0.3, measure)
    assert len(measured) >= 2 and measured[-1] <= 0.3 < measured[0]
    assert fit.measured == Estimate(measured[-1], 0.9 * measured[-1], measured[-1])
    assert fit.checks and fit.risk.point >= first.risk.point  # fewer checks, more risk
    assert "measured" in fit.notes[-1] and any("measured" in line for line in fit.lines())
    with pytest.raises(ConfigError, match=r"no schedule measured within 10% \(\d+ checks"):
        fit_measured(vuln, cost, rate, 0.10, measure)  # the engine alone measures 11.25%


def test_a_measured_fit_judges_the_upper_end_and_scales_the_budget_by_it(monkeypatch):
    """A measurement whose point fits the budget and whose upper end does not is not accepted
    (plan --verify ships what fits by the upper end); each retry's cost-model budget is what
    the model priced the last choice at (its upper end, at most the last budget) scaled by
    budget / measured upper end (not a fixed step, not the last budget when the choice sat far
    below it)."""
    from attnchecker.adaptive import controller

    vuln, cost = _vuln(), _cost()
    rate = FaultRate(1.0)
    points = {(s.layer, s.op): s.cost.high for s in sites(vuln, cost, rate)}
    measured: list[Estimate] = []

    def measure(choice):  # the additive model's sum as the point, its upper end 1.5x
        m = cost.engine.high + sum(points[(la, op)] / k for la, op, k in choice.checks)
        measured.append(Estimate(m, 0.9 * m, 1.5 * m))
        return measured[-1]

    budgets: list[float] = []
    priced_at: list[float] = []
    real = controller.choose

    def spy(*args, budget, **kw):  # the real choice; the budget it was asked for kept
        budgets.append(budget)
        choice = real(*args, budget=budget, **kw)
        priced_at.append(choice.overhead.high)
        return choice

    monkeypatch.setattr(controller, "choose", spy)
    fit = fit_measured(vuln, cost, rate, 0.3, measure)
    assert measured[0].point <= 0.3 < measured[0].high  # the point fit: not accepted
    assert len(measured) >= 2 and fit.measured == measured[-1] and fit.measured.high <= 0.3
    assert budgets[0] == 0.3
    for before, at, after, m in zip(budgets, priced_at, budgets[1:], measured, strict=False):
        assert after == pytest.approx(min(before, at) * 0.3 / m.high)
    # a cost model ten times too cheap: its choice within +300% (every check, priced +60%)
    # sits far below the budget; the retry starts from that price, and fits at the second try
    # (from the budget asked: four tries)
    budgets.clear(), priced_at.clear(), measured.clear()

    def ten_times(choice):
        return Estimate(*(10 * x for x in measure(choice)))

    fit = fit_measured(vuln, cost, rate, 3.0, ten_times)
    assert priced_at[0] < 1.0 and len(budgets) == 2, (budgets, priced_at)
    assert budgets[1] == pytest.approx(priced_at[0] * 3.0 / (10 * measured[0].high))
    assert fit.measured.high <= 3.0 and fit.measured == Estimate(*(10 * x for x in measured[-1]))


def test_the_engine_is_paid_only_by_a_schedule_with_a_core_check():
    """With no core check chosen the model's own attention runs (issue 42 §9): a budget below
    the engine's cost still buys the projections' checks, priced without it; a schedule with
    a core check pays it, once."""
    from attnchecker.adaptive.controller import priced

    fatal = {"scores": 50, "dw.q": 25}  # of 50 unprotected faults
    cells = tuple(Cell(op, layer, kind, 50, {"non_trainable": k, "masked": 50 - k},
                       {"non_trainable": 0, "masked": 50})
                  for op, k in fatal.items() for layer in (0, 1)
                  for kind in ("nan", "inf"))  # fmt: skip
    vuln = VulnerabilityProfile("gpt2", {"size": "tiny"}, cells)
    cost = CostProfile(
        "gpt2", {"layers": 2}, 0.01, Estimate(0.2, 0.1, 0.3), 10,
        tuple(OpCost(op, Estimate(0.02, 0.01, 0.03), 100) for op in fatal),
        tuple((layer, op, 1000) for layer in (0, 1) for op in fatal), step_macs=10_000,
    )  # fmt: skip
    rate = FaultRate(1.0)
    cheap = choose(vuln, cost, rate, budget=0.1)  # below the engine's upper end, 0.3
    assert {op for _, op, _ in cheap.checks} == {"dw.q"}
    # 100 launches per op over 2 layers: 50 a check, and not the engine's 10
    assert cheap.launches == pytest.approx(sum(50 / k for *_, k in cheap.checks))
    # an op's cost 0.02 is over both layers: 0.01 a check
    assert cheap.overhead.point == pytest.approx(sum(0.01 / k for *_, k in cheap.checks))
    rich = choose(vuln, cost, rate, budget=1.0)
    assert {op for _, op, _ in rich.checks} == {"scores", "dw.q"}
    assert rich.overhead.point == pytest.approx(0.2 + sum(0.01 / k for *_, k in rich.checks))
    one = {op: priced(vuln, cost, rate, ((0, op, 1),), goal="x").overhead.point for op in fatal}
    assert one == pytest.approx({"dw.q": 0.01, "scores": 0.21})
    target = choose(vuln, cost, rate, target=rich.risk.high * 1.5)  # cheapest that meets it
    assert target.overhead.point <= rich.overhead.point
    with pytest.raises(ConfigError, match="below the cheapest check"):
        choose(vuln, cost, rate, budget=0.0001)
