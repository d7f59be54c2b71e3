"""What protection buys, priced in training time: a campaign with recovery arms on a tiny GPT-2,
``bench``'s recovery arms, and ``plan``'s options, sentence and crossovers, through the CLI as a
user runs them."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from attnchecker.adaptive.controller import FaultRate
from attnchecker.adaptive.price import OPTIONS, PRESETS, Job, price
from attnchecker.adaptive.profile import CostProfile, Estimate
from attnchecker.cli import main
from attnchecker.errors import ConfigError
from attnchecker.inject.campaign import load_trials
from attnchecker.inject.trial import USER_OUTCOMES

SITES = ["scores", "dv"]


@pytest.fixture(scope="module")
def camp(tmp_path_factory):
    out = tmp_path_factory.mktemp("camp")
    args = ["--sites", *SITES, "--kinds", "nan", "near_inf", "--trials", "2", "--recovery-arms"]
    assert main(["campaign", "--out", str(out), "--families", "gpt2", *args]) == 0
    assert main(["bench", "--campaign", str(out), "--reps", "3", "--ops", *SITES]) == 0
    return out


def test_the_recovery_arms_class_each_fault_as_the_user_meets_it(camp):
    rows = load_trials(camp)
    assert len(rows) == 8
    for r in rows:
        if r["kind"] == "nan":  # a NaN: fatal unchecked; the guard sees it; ABFT repairs it
            assert r["unprotected"]["user"] == "non_trainable"
            assert r["guard_skip"]["user"] == "skipped" and r["guard_skip"]["skipped"] == 1
            # a transient fault replayed: exactly the fault-free run
            assert r["guard_replay"]["user"] == "replayed" and r["guard_replay"]["replayed"] == 1
            assert r["guard_replay"]["param_distance"] == 0.0
            assert r["protected_replay"]["user"] == "corrected"
        else:  # near-INF: finite, so no finite test sees it
            assert r["guard_replay"]["user"] in ("masked", "silent_deviation")
            assert r["guard_replay"]["replayed"] == 0
            assert r["protected_replay"]["user"] == "corrected"
        for arm in ("unprotected", "guard_skip", "guard_replay", "protected_replay"):
            assert r[arm]["user"] in USER_OUTCOMES
    assert any(r["guard_replay"]["user"] == "silent_deviation" for r in rows)


def test_bench_times_the_guard_and_the_default_protection(camp):
    cost = CostProfile.load(camp / "cost-gpt2.json")
    assert set(cost.recovery) == {"guard", "abft"}
    for e in cost.recovery.values():
        assert e.low <= e.point <= e.high


def _cost(camp, guard: float, abft: float) -> CostProfile:
    cost = CostProfile.load(camp / "cost-gpt2.json")
    return dataclasses.replace(
        cost, recovery={"guard": Estimate(guard, guard, guard), "abft": Estimate(abft, abft, abft)}
    )


def test_each_option_is_priced_from_its_outcomes_and_the_lines_cross_where_stated(camp):
    cost = _cost(camp, 0.001, 0.05)  # fixed overheads: the arithmetic, not this CPU's noise
    job = Job(step_seconds=2.0, devices=8, checkpoint_every=500, restart_seconds=600)
    pricing = price(camp, cost, FaultRate(1e-3, "device-hour"), job)
    prices = job.prices()
    assert prices["non_trainable"] == prices["silent_deviation"] == 250 + 300
    f = 1e-3 * 8 * 2.0 / 3600
    assert pricing.faults_per_step == pytest.approx(f)
    for p in pricing.options:
        assert sum(p.outcomes.values()) == pytest.approx(1.0)
        expected = sum(p.outcomes[o] * prices[o] for o in USER_OUTCOMES)
        assert p.per_fault.point == pytest.approx(expected)
        assert p.per_fault.low <= p.per_fault.point <= p.per_fault.high
        assert p.lost.point == pytest.approx(p.overhead.point + f * p.per_fault.point)
    names = {p.option.name: p for p in pricing.options}
    # the guard sees every NaN, ABFT repairs the near-INF the guard lets through
    assert names["guard_replay"].per_fault.point < names["none"].per_fault.point
    assert names["abft_replay"].per_fault.point < names["guard_replay"].per_fault.point
    assert pricing.best == "guard_replay"  # a rare fault: the cheap guard
    # at the stated crossover the two lines meet
    g, a = names["guard_replay"], names["abft_replay"]
    r = pricing.crossings["guard_replay"]["abft_replay"].point
    per_unit = 8 * 2.0 / 3600  # faults per step per fault per device-hour
    assert g.overhead.point + r * per_unit * g.per_fault.point == pytest.approx(
        a.overhead.point + r * per_unit * a.per_fault.point
    )
    assert pricing.above[0] == "abft_replay" and pricing.above[1].point == pytest.approx(r)
    low, high = pricing.above[1].low, pricing.above[1].high
    assert low <= r <= high and math.isfinite(high)
    # above it ABFT is the choice
    busy = price(camp, cost, FaultRate(2 * r, "device-hour"), job)
    assert busy.best == "abft_replay" and busy.below[0] == "guard_replay"
    assert busy.below[1].point == pytest.approx(r)


def test_a_dearer_silent_deviation_makes_abft_pay_sooner(camp):
    cost = _cost(camp, 0.001, 0.05)
    rate = FaultRate(1e-4, "step")

    def crossing(sdc: float) -> float:
        job = Job(step_seconds=1.0, sdc_steps=sdc)
        return price(camp, cost, rate, job).crossings["guard_replay"]["abft_replay"].point

    assert crossing(10_000) < crossing(100) < crossing(0)


def test_plan_answers_in_a_sentence_with_a_preset(camp, capsys):
    assert main(["plan", "--campaign", str(camp), "--preset", "llama3", "--step-seconds", "4"]) == 0
    out = capsys.readouterr().out
    quoted, devices, source = PRESETS["llama3"]
    assert quoted.value == pytest.approx(6 / (54 * 24 * 16384)) and devices == 16384
    assert "At 2.83e-07 faults per device-hour on 16,384 devices" in out and source in out
    assert "steps per day of training" in out and ": run " in out
    saved = json.loads((camp / "pricing.json").read_text())
    assert [o["name"] for o in saved["options"]] == [o.name for o in OPTIONS]
    assert saved["sentence"] in out
    # a GPU's overheads in place of this machine's
    given = ["--overheads", "guard=0,abft=1.7%"]
    assert main(["plan", "--campaign", str(camp), "--preset", "llama3", *given]) == 0
    out = capsys.readouterr().out
    assert "overheads given (--overheads)" in out and "guard +0.0%, abft +1.7%" in out
    abft = next(o for o in json.loads((camp / "pricing.json").read_text())["options"]
                if o["name"] == "abft_replay")  # fmt: skip
    assert abft["overhead"] == [0.017, 0.017, 0.017]
    assert main(["plan", "--campaign", str(camp), "--preset", "llama3", "--overheads", "x=1"]) == 2


def test_plan_needs_recovery_arms_to_price(tmp_path):
    out = tmp_path / "camp"
    args = ["--sites", "scores", "--kinds", "nan", "--trials", "1"]
    assert main(["campaign", "--out", str(out), "--families", "gpt2", *args]) == 0
    assert main(["bench", "--campaign", str(out), "--reps", "3", "--ops", "scores"]) == 0
    with pytest.raises(ConfigError, match="--recovery-arms"):
        price(out, CostProfile.load(out / "cost-gpt2.json"), FaultRate(1.0), Job(1.0))
    assert main(["plan", "--campaign", str(out), "--fault-rate", "1"]) == 2


def _check(camp, cost, options=("guard_replay", "abft_replay"), **kw):
    from attnchecker.adaptive.price_check import check_pricing
    from attnchecker.adaptive.profile import VulnerabilityProfile

    vuln = VulnerabilityProfile.load(camp / "vulnerability-gpt2.json")
    return check_pricing(vuln, cost, camp, FaultRate(5.0, "step"), steps=24, seeds=3,
                         held_out=(), timing_reps=3, options=options, **kw)  # fmt: skip


def test_validate_pricing_counts_fall_in_their_predictive_intervals(camp):
    """The options trained under sampled faults: their replays, corrections and silent
    deviations as predicted (overheads are timed on a loaded machine: judged in the probe
    below, where a twentyfold difference is not noise)."""
    check = _check(camp, CostProfile.load(camp / "cost-gpt2.json"))
    rows = {r.option: r for r in check.rows}
    assert [m for m in check.misses() if "overhead" not in m] == []
    guard, abft = rows["guard_replay"], rows["abft_replay"]
    assert sum(r.counts["replayed"] for r in guard.runs) > 0  # the NaN / INF faults
    deviated = sum(r.counts["silent_deviation"] for r in guard.runs)
    assert deviated > 0  # the near-INF the guard cannot see
    assert sum(len(r.distances) for r in guard.runs) == deviated  # each with its distance
    assert sum(r.counts["corrected"] for r in abft.runs) > 0
    assert sum(r.counts["silent_deviation"] for r in abft.runs) == 0  # corrected in place
    assert all(r.counts["non_trainable"] == 0 for row in check.rows for r in row.runs)
    # where ABFT pays, with the overheads measured in this check
    assert any("ABFT with replay" in n and "guard with replay" in n for n in check.notes)


def test_validate_pricing_fails_on_a_hidden_cost_and_on_a_hidden_deviation(camp, tmp_path):
    import shutil

    cost = CostProfile.load(camp / "cost-gpt2.json")
    cheap = dataclasses.replace(
        cost, recovery={**cost.recovery, "abft": cost.recovery["abft"].scaled(1 / 20)}
    )
    # a campaign whose guard with replay never deviated silently: every such trial relabelled
    lie = tmp_path / "camp"
    shutil.copytree(camp, lie)
    rows = load_trials(lie)
    for r in rows:
        if r["guard_replay"]["user"] == "silent_deviation":
            r["guard_replay"]["user"] = "masked"
    (lie / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    check = _check(lie, cheap)
    misses = check.misses()
    assert check.status == 1
    assert any(m.startswith("abft_replay (in-sample): overhead") and "ABOVE" in m for m in misses)
    assert any(m.startswith("guard_replay (in-sample): silent_deviation ABOVE") for m in misses)


def test_validate_pricing_through_the_cli(camp, tmp_path, capsys):
    out = tmp_path / "check"
    args = ["validate", "--campaign", str(camp), "--pricing", "--fault-rate", "5", "--per",
            "step", "--steps", "6", "--seeds", "2", "--no-held-out", "--timing-reps", "3",
            "--out", str(out)]  # fmt: skip
    assert main(args) in (0, 1, 3)  # the verdict is the tests above's; here, the wiring
    saved = json.loads((out / "pricing_check.json").read_text())
    assert [r["option"] for r in saved["rows"]] == [o.name for o in OPTIONS]
    assert "| guard_replay | in-sample |" in (out / "pricing_check.md").read_text()
    bad = ["validate", "--campaign", str(camp), "--pricing", "--fault-rate", "1e-3"]
    assert main(bad) == 2 and "--per step" in capsys.readouterr().err


def test_a_plan_is_priced_as_abft_where_it_checks_and_the_guard_elsewhere(camp, capsys):
    from attnchecker.adaptive.price import Mixture

    cost = _cost(camp, 0.001, 0.05)
    rows = load_trials(camp)
    every = tuple(sorted({(r["layer"], r["site"], 1) for r in rows}))
    half = tuple((layer, op, 2) for layer, op, _ in every)  # every other step
    mixtures = (Mixture("all", "all", every, Estimate(0.05, 0.05, 0.05)),
                Mixture("half", "half", half, Estimate(0.03, 0.03, 0.03)),
                Mixture("none", "none", (), Estimate(0.0, 0.0, 0.0)))  # fmt: skip
    p = price(camp, cost, FaultRate(1e-3, "step"), Job(1.0), mixtures=mixtures)
    e = {o.option.name: o.per_fault.point for o in p.options}
    assert e["all"] == pytest.approx(e["abft_replay"])
    assert e["none"] == pytest.approx(e["guard_replay"])
    assert e["half"] == pytest.approx((e["abft_replay"] + e["guard_replay"]) / 2)
    assert p.get("half").overhead.point == 0.03
    # plan --budget prices its schedule beside the options
    args = ["plan", "--campaign", str(camp), "--fault-rate", "0.01", "--per", "step",
            "--budget", "5000%"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "checks) with replay" in out.split("wrote")[-2]  # the table's last row


def test_a_deviation_is_judged_per_fault_from_the_same_state(camp, monkeypatch):
    """Each faulty step is forked (with its faults, without) from the state before it, for
    the campaign's horizon: a replaying option whose every fault is a NaN (replayed clean)
    deviates nowhere, however long the run; a near-INF the guard cannot see deviates at its
    step; the option without protection or guard is judged too."""
    from attnchecker.adaptive import price_check
    from attnchecker.adaptive.profile import VulnerabilityProfile
    from attnchecker.inject.plan import FaultPlan

    vuln = VulnerabilityProfile.load(camp / "vulnerability-gpt2.json")
    cost = CostProfile.load(camp / "cost-gpt2.json")
    option = {o.name: o for o in OPTIONS}
    drawn = price_check.plan

    def only(kind):
        def plan(*args):
            p = drawn(*args)
            return FaultPlan(tuple(dataclasses.replace(f, kind=kind) for f in p.faults))

        return plan

    def run(name, kind):
        monkeypatch.setattr(price_check, "plan", only(kind))
        return price_check.run_option(vuln, cost, FaultRate(30.0, "step"), option[name],
                                      steps=12, seed=0)  # fmt: skip

    nan = run("guard_replay", "nan")
    assert nan.faults > 3 and nan.counts["replayed"] > 3 and nan.counts["silent_deviation"] == 0
    near = run("guard_replay", "near_inf")
    assert near.counts["silent_deviation"] > 0
    assert all(d > 0 for d in near.distances)
    fixed = run("abft_replay", "near_inf")
    assert fixed.counts["corrected"] > 0 and fixed.counts["silent_deviation"] == 0
    bare = run("none", "nan")  # non-finite: non-trainable, rolled back; never a deviation
    assert bare.counts["non_trainable"] > 0 and bare.counts["silent_deviation"] == 0


def test_the_deviation_criterion_is_the_campaigns():
    """A loss 1e-5 away (relative) or a parameter the learning rate away (absolute)."""
    import torch

    from attnchecker.adaptive.price_check import deviates

    p = [torch.zeros(3), torch.ones(2)]
    moved = lambda d: [torch.tensor([0.0, d, 0.0]), torch.ones(2)]
    assert not deviates([2.0, 2.0], [2.0, 2.0], moved(0.5e-3), p, 1e-3)
    assert deviates([2.0, 2.0], [2.0, 2.0], moved(2e-3), p, 1e-3)  # the parameters only
    assert not deviates([2.0, 2.0 + 1e-5], [2.0, 2.0], p, p, 1e-3)
    assert deviates([2.0, 2.0 + 4e-5], [2.0, 2.0], p, p, 1e-3)  # the loss only


@pytest.mark.slow  # 33 s
def test_the_plans_schedule_against_naive_ones_at_its_measured_cost(camp, tmp_path):
    """``validate --pricing --budgets B``: the plan's schedule at B and each naive kind whose
    measured overhead fits under the schedule's, run as mixtures with their predictions; the
    schedule's gain over each is the paired difference of steps lost."""
    check = _check(camp, CostProfile.load(camp / "cost-gpt2.json"), ("guard_replay",),
                   budget=50.0)  # fmt: skip
    names = [r.option for r in check.rows]
    assert names[0] == "guard_replay" and names[1] == "plan at 5000%"
    mixtures = check.rows[1:]
    assert all(r.checks for r in mixtures)
    assert len(check.gains) == len(mixtures) - 1 >= 1
    job = Job(CostProfile.load(camp / "cost-gpt2.json").step_seconds)
    for g, r in zip(check.gains, mixtures[1:], strict=True):
        assert g.baseline == r.option
        assert list(g.differences) == [b - a for a, b in zip(mixtures[0].lost(job), r.lost(job),
                                                              strict=True)]  # fmt: skip
    assert [m for m in check.misses() if "overhead" not in m] == []
    assert "the plan's schedule against" in "\n".join(check.lines())
