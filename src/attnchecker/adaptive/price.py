"""What protection buys, in the user's currency: training time.

A fault that hits a training step ends as one of :data:`~attnchecker.inject.trial.USER_OUTCOMES`,
and each outcome costs steps of training (:class:`Job` holds the prices):

============================  =========================================================
outcome                       steps lost
============================  =========================================================
masked, corrected in place    0
replayed                      1 (the step is computed again)
skipped                       1 (a batch's update is lost)
non-trainable                 a restart: half a checkpoint interval recomputed, plus the
                              restart's time (relaunch, load) in steps
silent deviation              the user's price; default a restart's (found later, the run
                              goes back to a checkpoint from before it)
============================  =========================================================

An *option* (:data:`OPTIONS`) is what the user runs: nothing, the finite-gradient guard alone
skipping or replaying a step that went wrong, or ABFT (the default protection, correcting in
place) skipping or replaying what it cannot correct. A campaign's recovery arms
(``campaign --recovery-arms``) ran every option on the same faults, so for each site i (op x
layer) and kind k the share of trials in each outcome is measured. With faults landing on the
step's GEMMs in proportion to their work, the expected steps lost per fault and per step at
r faults per step are

    E = a * sum_i w_i sum_k pi_k sum_o P_iko price(o) + (1 - a) * E_other
    L(r) = C + r * E

with ``w_i`` site i's share of the profiled sites' multiply-adds, ``a`` the attention GEMMs'
share of the step's (faults at attention GEMMs the campaign left out are taken as its average
one) and C the option's measured overhead (``bench``'s recovery arms, a fraction of the plain
step; a negative median, noise, counts as 0). Faults outside attention (the MLP, the head) are
priced as the profiled faults without ABFT under the same recovery (``E_other``: ABFT with
``scope="attention"`` does not check them). Two options'
lines cross at ``r* = (C_b - C_a) / (E_a - E_b)``: below it the cheaper one to run wins, above
it the one that loses less per fault.

Intervals come from a paired bootstrap over the trials: each draw resamples every cell's trials,
the same draw for every option (the arms ran on the same faults), and gives every E and every
crossover; their quantiles are the intervals. The overheads enter at their medians (their own
intervals are shown beside them).

Not in these numbers: that a campaign's faults (one element of one GEMM of a small model, a
few steps watched) stand for the user's; that faults are independent of one another; the
price of a silent deviation, which only the user can set.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnchecker.adaptive.controller import FaultRate
from attnchecker.adaptive.profile import CostProfile, Estimate
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import linear_parts
from attnchecker.errors import ConfigError
from attnchecker.inject.plan import check_op
from attnchecker.inject.trial import USER_OUTCOMES

__all__ = [
    "OPTIONS", "PRESETS", "Job", "Mixture", "Option", "Pricing", "price", "quantiles", "shares",
    "trials_of",
]  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One way to run: its name, what it is, the campaign arm that measured it at the profiled
    sites, the arm that stands for it elsewhere (no ABFT there), and the cost profile's recovery
    arm that timed it (None: nothing added to the plain step)."""

    name: str
    label: str
    arm: str
    other: str
    cost: str | None


OPTIONS = (
    Option("none", "no protection", "unprotected", "unprotected", None),
    Option("guard_replay", "the finite-gradient guard with replay", "guard_replay",
           "guard_replay", "guard"),
    Option("guard_skip", "the finite-gradient guard, skipping", "guard_skip", "guard_skip",
           "guard"),
    Option("abft_replay", "ABFT with replay", "protected_replay", "guard_replay", "abft"),
    Option("abft_skip", "ABFT, skipping what it cannot correct", "protected_skip", "guard_skip",
           "abft"),
)  # fmt: skip
"""In order of preference where two cost the same (a replay keeps the fault-free trajectory,
a skip drops a batch)."""


@dataclass(frozen=True)
class Mixture:
    """ABFT on some sites, the guard with replay on the rest: a schedule (``(layer, op,
    every)``, the controller's choice) with its overhead. At a scheduled site a fault ends as
    the protected arm's did, every ``every``-th step, else as the guard's (a check credited with
    its own site only: the protected arm ran every check)."""

    name: str
    label: str
    checks: tuple[tuple[int, str, int], ...]
    overhead: Estimate

    @property
    def option(self) -> Option:
        return Option(self.name, self.label, self.name, "guard_replay", None)


PRESETS = {
    "llama3": (
        FaultRate(6 / (54 * 24 * 16384), "device-hour"),
        16384,
        "the Llama 3 report (Meta, 2024): 6 silent data corruptions in 54 days on 16,384 GPUs",
    ),
}
"""Fault rates people quote: name -> (rate per device, devices, source)."""


@dataclass(frozen=True)
class Job:
    """The user's training job, and what each outcome costs in it (module docstring)."""

    step_seconds: float  # one plain training step of the job
    devices: int = 1  # devices whose faults hit each step (data parallel: all of them)
    checkpoint_every: int = 1000  # steps between checkpoints
    restart_seconds: float = 900.0  # from a non-trainable state back to training: relaunch, load
    sdc_steps: float | None = None  # price of a silent deviation in steps (None: a restart's)

    def __post_init__(self) -> None:
        if not self.step_seconds > 0 or self.devices < 1 or self.checkpoint_every < 1:
            raise ConfigError("the step time must be > 0, devices and checkpoint_every >= 1")
        if self.restart_seconds < 0 or (self.sdc_steps is not None and self.sdc_steps < 0):
            raise ConfigError("a restart's time and a silent deviation's price must be >= 0")

    @property
    def restart_steps(self) -> float:
        return self.checkpoint_every / 2 + self.restart_seconds / self.step_seconds

    def prices(self) -> dict[str, float]:
        """Steps lost per outcome."""
        sdc = self.restart_steps if self.sdc_steps is None else self.sdc_steps
        return {"masked": 0.0, "corrected": 0.0, "replayed": 1.0, "skipped": 1.0,
                "silent_deviation": sdc, "non_trainable": self.restart_steps}  # fmt: skip

    def faults_per_step(self, rate: FaultRate, cost: CostProfile) -> float:
        """Faults per step of the whole job at ``rate`` (per device for the time units)."""
        if rate.per == "step":
            return rate.value
        if rate.per == "element-op":
            return rate.value * cost.step_macs * self.devices
        hours = {"device-hour": 1.0, "device-day": 24.0}[rate.per]
        return rate.value * self.devices * self.step_seconds / (3600 * hours)

    @property
    def steps_per_day(self) -> float:
        """Steps of the plain job, fault-free, in a day."""
        return 86400 / self.step_seconds


@dataclass(frozen=True)
class Priced:
    """One option at the rate: its overhead, the outcomes of a fault, the steps lost."""

    option: Option
    overhead: Estimate  # a fraction of the plain step
    outcomes: dict[str, float]  # P(outcome | a fault), point
    per_fault: Estimate  # expected steps lost per fault (E), bootstrap interval
    lost: Estimate  # expected steps lost per step (L = C + r E)
    note: str = ""


@dataclass(frozen=True)
class Pricing:
    """Every option at one fault rate, the cheapest, and where the next ones take over."""

    rate: FaultRate
    job: Job
    faults_per_step: float
    coverage: float  # the attention GEMMs' share of the step's multiply-adds
    options: tuple[Priced, ...]
    best: str
    above: tuple[str, Estimate] | None  # the option cheaper above a fault rate (in rate.per)
    below: tuple[str, Estimate] | None  # ... below one
    trials: int
    notes: tuple[str, ...] = ()
    crossings: dict[str, dict[str, Estimate]] = field(default_factory=dict)

    def get(self, name: str) -> Priced:
        return next(p for p in self.options if p.option.name == name)

    def lost_per_day(self, p: Priced, end: int = 0) -> float:
        """Steps lost per day of training: the fault-free plain job's steps in a day less those
        done at ``1 + L`` times its step time."""
        lost = p.lost[end]
        return self.job.steps_per_day * lost / (1 + lost)

    def sentence(self) -> str:
        """``attnchecker plan``'s answer (item 4 of the pricing issue)."""
        b = self.get(self.best)
        unit = f"per {self.rate.per}"
        s = (f"At {self.rate.value:.3g} faults {unit}"
             + (f" on {self.job.devices:,} devices" if self.rate.per.startswith("device") else "")
             + f" ({self.faults_per_step:.3g} per step of {self.job.step_seconds:g} s): run "
             f"{b.option.label}, {b.overhead.point:+.1%} overhead, expected to lose "
             f"{self.lost_per_day(b):.3g} steps per day of training [{self.lost_per_day(b, 1):.3g}"
             f", {self.lost_per_day(b, 2):.3g}] (of {self.job.steps_per_day:,.0f})")  # fmt: skip
        if self.above is not None:
            name, r = self.above
            s += f"; {self.get(name).option.label} becomes cheaper above {_rate(r)} {unit}"
        if self.below is not None:
            name, r = self.below
            s += f"; below {_rate(r)} {unit}, {self.get(name).option.label}"
        return s + "."

    def lines(self) -> list[str]:
        """The table and the sentence."""
        prices, job = self.job.prices(), self.job
        out = [
            f"what a fault costs: replayed / skipped 1 step; non-trainable "
            f"{prices['non_trainable']:.4g} steps (half of {job.checkpoint_every} between "
            f"checkpoints + a {job.restart_seconds:g} s restart); silent deviation "
            f"{prices['silent_deviation']:.4g} steps"
            + (" (default: a restart's)" if job.sdc_steps is None else ""),
            f"{'option':<40} {'overhead':>16}  {'per fault: ' + ' / '.join(_SHORT):<44} "
            f"{'steps lost per fault':>22}  steps lost per day",
        ]  # fmt: skip
        for p in self.options:
            shares = " / ".join(f"{p.outcomes.get(o, 0.0):.2f}" for o in USER_OUTCOMES)
            out.append(
                f"{p.option.label:<40} {p.overhead.point:+6.1%} [{p.overhead.low:+.1%}, "
                f"{p.overhead.high:+.1%}]  {shares:<44} {p.per_fault.point:9.3g} "
                f"[{p.per_fault.low:.3g}, {p.per_fault.high:.3g}]  {self.lost_per_day(p):.4g}"
                + (" *" if p.option.name == self.best else "")
                + (f"  ({p.note})" if p.note else "")
            )
        return [*out, self.sentence(), *(f"note: {n}" for n in self.notes)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": vars(self.rate), "job": vars(self.job), "faults_per_step": self.faults_per_step,
            "coverage": self.coverage, "trials": self.trials, "best": self.best,
            "above": self.above, "below": self.below, "sentence": self.sentence(),
            "options": [{"name": p.option.name, "label": p.option.label,
                         "overhead": p.overhead, "outcomes": p.outcomes,
                         "per_fault": p.per_fault, "lost_per_step": p.lost,
                         "lost_per_day": self.lost_per_day(p), "note": p.note}
                        for p in self.options],
            "crossings": self.crossings, "notes": list(self.notes),
        }  # fmt: skip


_SHORT = ("masked", "corrected", "replayed", "skipped", "sdc", "dead")


def _rate(r: Estimate) -> str:
    def one(x: float) -> str:
        return "never" if math.isinf(x) else f"{x:.3g}"

    return f"{one(r.point)} [{one(r.low)}, {one(r.high)}]"


def trials_of(campaign: str | Path, family: str) -> list[dict[str, Any]]:
    """The campaign's trials of ``family`` that ran every option's arms; raises
    :class:`ConfigError` when it has none (a campaign without ``--recovery-arms``)."""
    from attnchecker.inject.campaign import load_trials

    arms = {o.arm for o in OPTIONS} | {o.other for o in OPTIONS}
    rows = [r for r in load_trials(Path(campaign)) if r["family"] == family]
    rows = [r for r in rows if all(a in r for a in arms)]
    if not rows:
        raise ConfigError(
            f"{campaign} has no trials of {family} with the recovery arms: run the campaign with "
            f"--recovery-arms (attnchecker campaign ... --recovery-arms)"
        )
    return rows


def _user(arm: dict[str, Any]) -> str:
    from attnchecker.inject.trial import user_outcome

    return arm.get("user") or user_outcome(arm)


def _overheads(cost: CostProfile) -> tuple[dict[str | None, Estimate], dict[str, str]]:
    """Each option's overhead: the cost profile's recovery arms, or for a profile measured
    before them the sum of its parts (with a note)."""
    out: dict[str | None, Estimate] = {None: Estimate(0.0, 0.0, 0.0)}
    notes: dict[str, str] = {}
    out["guard"] = cost.recovery.get("guard", Estimate(0.0, 0.0, 0.0))
    if "guard" not in cost.recovery:
        notes["guard"] = "guard not timed by this cost profile: taken as 0"
    if "abft" in cost.recovery:
        out["abft"] = cost.recovery["abft"]
    else:
        ops = [o for o in cost.ops if o.op in ABFTConfig().ops]
        out["abft"] = Estimate(*(cost.engine[j] + sum(o.cost[j] for o in ops) for j in range(3)))
        notes["abft"] = "the engine and the default ops' costs summed (rerun bench to time it)"
    return out, notes


def shares(campaign: str | Path, cost: CostProfile, kinds: dict[str, float] | None = None, *,
           mixtures: tuple[Mixture, ...] = (), draws: int = 2000,
           seed: int = 0) -> tuple[dict[str, Tensor], int, int]:  # fmt: skip
    """Per arm (and per mixture, by its name), the probability of each outcome
    (:data:`USER_OUTCOMES`, columns) of a fault at the campaign's sites, weighted by their
    multiply-adds and ``kinds`` (None: uniform): row 0 the trials as they are, then ``draws``
    paired bootstrap draws (every cell's trials resampled, the same resample for every arm);
    (that, the trials, the profiled sites)."""
    rows = trials_of(campaign, cost.family)
    measured = sorted({r["kind"] for r in rows})
    pi = kinds or {k: 1 / len(measured) for k in measured}
    if unknown := sorted(set(pi) - set(measured)):
        raise ConfigError(f"kinds {unknown} were not in the campaign; it has {measured}")
    cells: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for r in rows:
        cells[(check_op(r["site"]), r.get("layer", 0), r["kind"])].append(r)
    macs = {(op, layer): m for layer, op, m in cost.macs}
    sites = {(op, layer) for op, layer, _ in cells if (op, layer) in macs}
    if not sites:
        raise ConfigError("the campaign's sites and the cost profile's GEMMs have none in common")
    total = sum(macs[s] for s in sites)
    arms = sorted({o.arm for o in OPTIONS} | {o.other for o in OPTIONS})
    zeros = lambda: torch.zeros(draws + 1, len(USER_OUTCOMES), dtype=torch.float64)
    out = {a: zeros() for a in [*arms, *(m.name for m in mixtures)]}
    checked = {m.name: {(op, layer): 1 / every for layer, op, every in m.checks}
               for m in mixtures}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for (op, layer, kind), rs in sorted(cells.items()):
        if (op, layer) not in sites or kind not in pi:
            continue
        w = macs[op, layer] / total * pi[kind]
        idx = torch.randint(0, len(rs), (draws, len(rs)), generator=g)  # the same for every arm
        onehots = {}
        for a in arms:
            onehot = torch.zeros(len(rs), len(USER_OUTCOMES), dtype=torch.float64)
            for i, r in enumerate(rs):
                onehot[i, USER_OUTCOMES.index(_user(r[a]))] = 1.0
            onehots[a] = onehot
        for m in mixtures:
            f = checked[m.name].get((op, layer), 0.0)
            onehots[m.name] = f * onehots["protected_replay"] + (1 - f) * onehots["guard_replay"]
        for a, onehot in onehots.items():
            out[a][0] += w * onehot.mean(0)
            out[a][1:] += w * onehot[idx].mean(1)
    return out, len(rows), len(sites)


def quantiles(x: Tensor, level: float) -> Estimate:
    """Row 0 of ``x`` and the ``level`` interval of the rest (the draws)."""
    lo = torch.quantile(x[1:], (1 - level) / 2, interpolation="lower")
    hi = torch.quantile(x[1:], (1 + level) / 2, interpolation="higher")
    return Estimate(float(x[0]), float(lo), float(hi))


def price(campaign: str | Path, cost: CostProfile, rate: FaultRate, job: Job, *,
          mixtures: tuple[Mixture, ...] = (), draws: int = 2000, level: float = 0.9,
          seed: int = 0) -> Pricing:  # fmt: skip
    """Every option of :data:`OPTIONS` and every ``mixture`` at ``rate`` for ``job`` (module
    docstring)."""
    share, trials, n_sites = shares(campaign, cost, rate.kinds, mixtures=mixtures, draws=draws,
                                    seed=seed)  # fmt: skip
    macs = {(op, layer): m for layer, op, m in cost.macs}
    coverage = sum(m for (op, _), m in macs.items() if not linear_parts(op)) / cost.step_macs
    prices = job.prices()
    vector = torch.tensor([prices[o] for o in USER_OUTCOMES], dtype=torch.float64)
    overheads, cost_notes = _overheads(cost)
    f = job.faults_per_step(rate, cost)
    per_fault, priced = {}, []

    def interval(x: Tensor) -> Estimate:
        return quantiles(x, level)

    given = {m.name: m.overhead for m in mixtures}
    for o in (*OPTIONS, *(m.option for m in mixtures)):
        mixed = coverage * share[o.arm] + (1 - coverage) * share[o.other]  # (draws + 1, outcomes)
        per_fault[o.name] = mixed @ vector
        c = Estimate(*(max(0.0, x) for x in given.get(o.name, overheads[o.cost])))
        e = interval(per_fault[o.name])
        outcomes = {u: float(mixed[0, j]) for j, u in enumerate(USER_OUTCOMES)}
        lost = Estimate(c.point + f * e.point, c.point + f * e.low, c.point + f * e.high)
        priced.append(Priced(o, c, outcomes, e, lost, cost_notes.get(o.cost or "", "")))
    best = min(priced, key=lambda p: p.lost.point).option.name
    per_unit = job.faults_per_step(FaultRate(1.0, rate.per), cost)
    crossings = _crossings(priced, per_fault, per_unit, interval)
    above, below = _neighbours(priced, best, crossings, f / per_unit)
    notes = (
        f"faults in attention ({coverage:.0%} of the step's multiply-adds) as the campaign "
        f"measured them at {n_sites} of its GEMMs; the rest (MLP, head) priced as those "
        f"faults without ABFT",
        f"intervals: {level:.0%}, a paired bootstrap of the campaign's {trials} trials "
        f"(overheads at their medians)",
    )
    return Pricing(rate, job, f, coverage, tuple(priced), best, above, below, trials, notes,
                   crossings)  # fmt: skip


def _crossings(priced: list[Priced], per_fault: dict[str, Tensor], per_unit: float,
               interval) -> dict[str, dict[str, Estimate]]:  # fmt: skip
    """For each pair (a, b) with b dearer to run: the fault rate (in the rate's unit) above
    which b loses less than a, per draw (inf where b never does)."""
    out: dict[str, dict[str, Estimate]] = defaultdict(dict)
    for a in priced:
        for b in priced:
            if b.overhead.point <= a.overhead.point or a is b:
                continue
            gain = per_fault[a.option.name] - per_fault[b.option.name]  # per fault, per draw
            dearer = b.overhead.point - a.overhead.point
            r = torch.where(gain > 0, dearer / gain.clamp_min(1e-300), math.inf)
            out[a.option.name][b.option.name] = interval(r / per_unit)
    return dict(out)


Neighbour = tuple[str, Estimate] | None


def _neighbours(priced: list[Priced], best: str, crossings: dict[str, dict[str, Estimate]],
                value: float) -> tuple[Neighbour, Neighbour]:  # fmt: skip
    """The option that overtakes ``best`` first as the rate rises above ``value``, and the one
    that takes over first as it falls below."""
    above = [(r, b) for b, r in crossings.get(best, {}).items() if r.point > value]
    below = [(r, a) for a, rs in crossings.items() for b, r in rs.items()
             if b == best and r.point < value]  # fmt: skip
    up = min(above, key=lambda x: x[0].point, default=None)
    down = max(below, key=lambda x: x[0].point, default=None)
    return (None if up is None else (up[1], up[0])), (None if down is None else (down[1], down[0]))
