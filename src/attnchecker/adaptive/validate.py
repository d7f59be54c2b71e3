"""Check the controller's claims, so that they can fail: ``attnchecker validate``.

Each *row* is a schedule trained under sampled faults (:mod:`.simulate`) for several seeds, each
seed its own fault plan and the same plans in every row (paired): the controller's choice at
each budget and with no check (in-sample), naive baselines at a budget, and the choice under
held-out conditions (another init seed, Shakespeare text, a trained checkpoint, other fault
patterns, kinds and rates, sites the campaign never faulted).

Counts. A row's predicted count is a *predictive interval* at a stated level (default 90%): a
parametric bootstrap of the controller's model. Each draw takes every cell's non-trainable
probabilities from their posteriors (Jeffreys prior, the campaign's counts: a Beta per arm, or
with check arms a Dirichlet over the joint histogram, so that the rates under different check
sets stay consistent), forms the expected count mu = steps * sum_i lambda_i * sum_k pi_k *
(the rate of kind k at i under the checks that run, averaged over the steps)
(:mod:`.controller`) and draws a Poisson count of mean mu; the interval is the counts'
quantiles. Calibrated, about ``level`` of the seeds' counts fall inside. A set of counts
*misses* when fewer fall inside than the level allows (one-sided binomial test at 5%): ABOVE
when most misses lie above (more events than claimed), BELOW when most lie below (the model
is wrong on the safe side: still wrong). Tested per row and pooled over the judged rows.

Overhead. Measured once per row (alternated clean steps against the plain model with SDPA,
median and its interval): the budget is a contract, so a row whose measured overhead is above
its budget misses (OVER BUDGET), as does one outside its predicted interval (ABOVE / BELOW).

Baselines, at equal measured cost. Three naive kinds: every check every k steps, the
forward's checks only every k steps, and a random subset of checks every step, each a ladder of
schedules from cheap to dear (:func:`ladders`). Of each kind the dearest schedule whose
overhead, measured as a row's is, stays at most the overhead the controller's choice at one
budget measured (:func:`matched`, a bisection: a few measurements per kind), so a baseline
gets what the controller's schedule really cost, not what the cost model says it costs (which
favoured the controller: costs do not add per op). The controller's gain over each is the
paired difference of the seeds' counts (baseline minus controller), with a t interval.

The reference (with the baselines): no check at all, the optimizer guarded by the finite-
gradient test (:class:`~attnchecker.recovery.guard.FiniteGradients`, what a user has without
ABFT: an update that would put a NaN or INF into the weights is skipped); its counts, updates
skipped and overhead are reported, not judged (the model does not predict it).

Exit status (``Validation.status``): 0 when nothing misses, 1 when a count or an overhead is
above its claim or a budget is exceeded, 3 when the only misses are below their claims.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnchecker.adaptive.controller import (
    Choice,
    FaultRate,
    choose,
    fit_measured,
    priced,
    sites,
)
from attnchecker.adaptive.knapsack import PERIODS, active_checks
from attnchecker.adaptive.profile import (
    Cell,
    CostProfile,
    Estimate,
    VulnerabilityProfile,
    relative,
)
from attnchecker.adaptive.simulate import (
    Condition,
    Run,
    gradient_guard_overhead,
    measure_overhead,
    overhead,
    plan,
    run,
)
from attnchecker.attention.ops import in_backward
from attnchecker.errors import ConfigError

__all__ = [
    "HELD_OUT",
    "Gain",
    "Prediction",
    "Row",
    "Validation",
    "baselines",
    "binomial_miss",
    "ladders",
    "matched",
    "predict",
    "validate",
]

ALPHA = 0.05  # the binomial test's level
HELD_OUT = (
    Condition("init seed 7", model_seed=7),
    Condition("Shakespeare text", data="shakespeare"),
    Condition("checkpoint after 300 clean steps", pretrain=300),
    Condition("patterns 1R / 1C / 2D", patterns=("1R", "1C", "2D")),
    Condition("unseen kinds: -inf, random values", kinds={"-inf": 0.5, "random": 0.5}),
    Condition("rate x 0.5", rate_scale=0.5),
    Condition("rate x 2", rate_scale=2.0),
    Condition("unprofiled sites only", unprofiled=True, judged=False),
)
"""The held-out rows: what the campaign (and so the prediction) never saw. Faults at the sites
the campaign did not fault are not in the prediction at all (it is 0 there): that row shows
what the stated coverage leaves: its counts are reported, not judged (its overhead is)."""


@dataclass(frozen=True)
class Prediction:
    """The predicted count of non-trainable events in a run: its mean and the ``level``
    predictive interval [low, high]."""

    mean: float
    low: int
    high: int
    level: float


def predict(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate,
            checks: tuple[tuple[int, str, int], ...], steps: int, *, level: float = 0.9,
            draws: int = 4000, seed: int = 0) -> Prediction:  # fmt: skip
    """The predictive interval of a run's count (module docstring)."""
    if not 0 < level < 1:
        raise ConfigError(f"level must be in (0, 1), got {level!r}")
    ss = sites(vuln, cost, rate)
    every = {(layer, op): 1 / k for layer, op, k in checks}
    f = {i: every[s.layer, s.op] for i, s in enumerate(ss) if (s.layer, s.op) in every}
    alphas: dict[tuple, list[float]] = {}  # posterior -> its Dirichlet's parameters
    weights: dict[tuple, float] = defaultdict(float)  # (posterior, lost, eligible) -> weight
    active = active_checks(ss, f)
    for s in ss:
        for p, cell in s.cells:
            for share, on in active:
                arm, counts, lost, eligible = _categories(cell, s.names(on))
                post = (cell.op, cell.layer, cell.kind, arm)
                alphas.setdefault(post, [n + 0.5 for n in counts])
                weights[post, lost, eligible] += steps * s.faults * p * share
    if not weights:
        return Prediction(0.0, 0, 0, level)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dirichlet = torch.distributions.Dirichlet
        probs = {post: dirichlet(torch.tensor(a, dtype=torch.float64)).sample((draws,))
                 for post, a in alphas.items()}  # (draws, categories)  # fmt: skip
        mu = torch.zeros(draws, dtype=torch.float64)
        for (post, lost, eligible), w in weights.items():  # w x the rate among the eligible
            P = probs[post]
            mu += w * P[:, list(lost)].sum(1) / P[:, list(eligible)].sum(1)
        counts = torch.poisson(mu)
    low = torch.quantile(counts, (1 - level) / 2, interpolation="lower")
    high = torch.quantile(counts, (1 + level) / 2, interpolation="higher")
    return Prediction(float(mu.mean()), int(low), int(high), level)


def _categories(cell: Cell, on: frozenset[str]):
    """The posterior of ``cell`` and the categories that make its non-trainable rate while the
    checks ``on`` run (named relative to the fault's layer, :meth:`Cell.rate_with`): (arm,
    every category's count, the lost categories, the eligible ones; the rate is the first's
    share of the second). Without check arms: the unprotected or the protected arm's Beta,
    category 0 lost of both. With them: a Dirichlet over the joint histogram's keys
    (:meth:`Cell.categories`), plus two unseen categories (non-trainable under every check
    set, trainable under every one) so that a rate of 0 in the trials is not certain."""
    if not cell.checks:
        arm = "protected" if relative(cell.op, 0) in on else "unprotected"
        k = getattr(cell, arm).get("non_trainable", 0)
        return arm, (k, cell.trials - k), (0,), (0, 1)
    cats = cell.categories(on)
    n = len(cats)
    counts = (*(t for *_, t in cats), 0, 0)  # ..., lost under every check, trainable
    lost = (*(i for i, (x, e, _) in enumerate(cats) if x and e), n)
    eligible = (*(i for i, (_, e, _) in enumerate(cats) if e), n, n + 1)
    return "joint", counts, lost, eligible


def binomial_miss(inside: int, n: int, level: float, alpha: float = ALPHA) -> bool:
    """Whether ``inside`` of ``n`` counts in their ``level`` intervals is too few: P(X <= inside)
    < alpha for X ~ Binomial(n, level)."""
    if n == 0:
        return False
    p = sum(math.comb(n, j) * level**j * (1 - level) ** (n - j) for j in range(inside + 1))
    return p < alpha


def _outside(rows) -> tuple[int, int, str]:
    """(counts above their intervals, below, the side most misses lie on) over ``rows``."""
    above = sum(x.events > r.predicted.high for r in rows for x in r.runs)
    below = sum(x.events < r.predicted.low for r in rows for x in r.runs)
    return above, below, "ABOVE" if above >= below else "BELOW"


@dataclass(frozen=True)
class Row:
    """One schedule trained under faults for several seeds, against its predictions."""

    name: str
    kind: str  # "in-sample", "baseline" or "held-out"
    budget: float | None
    checks: tuple[tuple[int, str, int], ...]
    condition: Condition
    steps: int
    runs: tuple[Run, ...]
    predicted: Prediction
    overhead: Estimate  # measured, fraction of the plain step
    predicted_overhead: Estimate
    seconds: float

    @property
    def judged(self) -> bool:
        return self.condition.judged

    @property
    def inside(self) -> int:
        return sum(self.predicted.low <= r.events <= self.predicted.high for r in self.runs)

    @property
    def count_verdict(self) -> str:
        """inside, or ABOVE / BELOW when too few counts fall in the interval; "not judged"
        for a row whose counts the model does not predict."""
        if not self.judged:
            return "not judged"
        if not binomial_miss(self.inside, len(self.runs), self.predicted.level):
            return "inside"
        return _outside([self])[2]

    @property
    def overhead_verdict(self) -> str:
        """inside, OVER BUDGET (the measured overhead's upper end above the budget: the
        contract broke; judged by the end ``plan --verify`` fits a budget by,
        :func:`~attnchecker.adaptive.controller.fit_measured`), ABOVE / BELOW the predicted
        interval (the point); "not judged" for the reference (no prediction)."""
        if self.kind == "reference":
            return "not judged"
        o, q = self.overhead.point, self.predicted_overhead
        if self.budget is not None and self.checks and self.overhead.high > self.budget:
            return "OVER BUDGET"
        if o > q.high:
            return "ABOVE"
        return "BELOW" if o < q.low else "inside"

    def misses(self) -> list[str]:
        """This row's misses, worded (a row not judged: its overhead only, the same schedule's
        cost whatever the faults)."""
        out = []
        if self.judged and (v := self.count_verdict) != "inside":
            out.append(f"{self.name}: counts {v} the {self.predicted.level:.0%} interval "
                       f"[{self.predicted.low}, {self.predicted.high}] ({self.inside} of "
                       f"{len(self.runs)} inside: {[r.events for r in self.runs]})")  # fmt: skip
        if (v := self.overhead_verdict) not in ("inside", "not judged"):
            q = self.predicted_overhead
            o = self.overhead
            out.append(f"{self.name}: overhead {o.point:+.1%} [{o.low:+.1%}, {o.high:+.1%}] {v} "
                       + (f"(budget {self.budget:.0%}, upper end)" if v == "OVER BUDGET" else
                          f"the predicted [{q.low:+.1%}, {q.high:+.1%}]"))  # fmt: skip
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "budget": self.budget,
                "checks": self.checks, "condition": self.condition.to_dict(),
                "steps": self.steps, "runs": [vars(r) for r in self.runs],
                "predicted": vars(self.predicted), "overhead": self.overhead,
                "predicted_overhead": self.predicted_overhead, "seconds": self.seconds,
                "inside": self.inside, "count_verdict": self.count_verdict,
                "overhead_verdict": self.overhead_verdict}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        return cls(d["name"], d["kind"], d["budget"], tuple(tuple(c) for c in d["checks"]),
                   Condition(**{k: tuple(v) if k == "patterns" and v else v
                                for k, v in d["condition"].items()}),
                   d["steps"], tuple(Run(**r) for r in d["runs"]), Prediction(**d["predicted"]),
                   Estimate(*d["overhead"]), Estimate(*d["predicted_overhead"]),
                   d["seconds"])  # fmt: skip


_T975 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228}  # fmt: skip


@dataclass(frozen=True)
class Gain:
    """The controller's gain over a baseline at equal budget: the paired differences of the
    seeds' counts (baseline - controller; > 0: the controller lost fewer steps), their mean
    and its 95% t interval."""

    baseline: str
    differences: tuple[int, ...]

    @property
    def mean(self) -> Estimate:
        d = self.differences
        m = sum(d) / len(d)
        if len(d) < 2:
            return Estimate(m, math.nan, math.nan)
        sd = math.sqrt(sum((x - m) ** 2 for x in d) / (len(d) - 1))
        half = _T975.get(len(d) - 1, 1.96) * sd / math.sqrt(len(d))
        return Estimate(m, m - half, m + half)

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "differences": self.differences, "mean": self.mean}


@dataclass(frozen=True)
class Validation:
    rows: tuple[Row, ...]
    gains: tuple[Gain, ...]
    level: float
    notes: tuple[str, ...] = ()  # budgets left out (no check fits them), ...

    def coverage(self, kind: str | None = None) -> tuple[int, int]:
        """(counts inside their intervals, counts) over the judged rows (of ``kind``)."""
        rows = [r for r in self.rows if r.judged and (kind is None or r.kind == kind)]
        return sum(r.inside for r in rows), sum(len(r.runs) for r in rows)

    def misses(self) -> list[str]:
        out = [m for r in self.rows for m in r.misses()]
        inside, n = self.coverage()
        if binomial_miss(inside, n, self.level):
            above, below, side = _outside([r for r in self.rows if r.judged])
            out.append(f"pooled: {inside} of {n} counts inside their {self.level:.0%} intervals "
                       f"({above} above, {below} below): {side}")  # fmt: skip
        return out

    @property
    def status(self) -> int:
        """0: no miss; 1: a claim broken upwards (more events, more overhead, over budget);
        3: misses only below the claims."""
        misses = self.misses()
        if not misses:
            return 0
        return 1 if any("ABOVE" in m or "OVER BUDGET" in m for m in misses) else 3

    def to_dict(self) -> dict[str, Any]:
        inside, n = self.coverage()
        return {"level": self.level, "coverage": [inside, n], "status": self.status,
                "misses": self.misses(), "rows": [r.to_dict() for r in self.rows],
                "gains": [g.to_dict() for g in self.gains], "notes": list(self.notes)}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Validation:
        return cls(tuple(Row.from_dict(r) for r in d["rows"]),
                   tuple(Gain(g["baseline"], tuple(g["differences"])) for g in d["gains"]),
                   d["level"], tuple(d.get("notes", ())))  # fmt: skip


Checks = tuple[tuple[int, str, int], ...]


def ladders(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, *,
            seed: int = 0) -> dict[str, list[tuple[str, Checks]]]:  # fmt: skip
    """Each naive kind's schedules, cheapest first: every check and the forward's checks only,
    every k steps for k from the longest period down to 1; a random subset (its order drawn
    from ``seed``) of 1, 2, ... of the sites, every step."""
    ss = sites(vuln, cost, rate)
    out = {}
    forward = [s for s in ss if not in_backward(s.op)]
    for name, chosen in (("every check", ss), ("forward only", forward)):
        if chosen:
            out[name] = [(f"{name} (every {k})" if k > 1 else name,
                          tuple((s.layer, s.op, k) for s in chosen))
                         for k in reversed((1, *PERIODS))]  # fmt: skip
    order = list(ss)
    random.Random(seed).shuffle(order)
    out["random subset"] = [(f"random subset ({n} of {len(order)})",
                             tuple((s.layer, s.op, 1) for s in order[:n]))
                            for n in range(1, len(order) + 1)]  # fmt: skip
    return out


def matched(ladder: list[tuple[str, Checks]], measure: Callable[[Checks], float],
            target: float) -> tuple[int, dict[int, float]]:  # fmt: skip
    """The index of the dearest rung of ``ladder`` whose measured overhead is at most
    ``target`` (-1: not even the cheapest), found by bisection (a rung costs more than the one
    before it), and every overhead measured on the way."""
    seen: dict[int, float] = {}
    lo, hi = -1, len(ladder)  # lo fits (or is before the first rung), hi does not (or is past)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen[mid] = measure(ladder[mid][1])
        lo, hi = (mid, hi) if seen[mid] <= target else (lo, mid)
    return lo, seen


def baselines(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, target: float,
              measure: Callable[[Checks], float], *, seed: int = 0,
              ) -> tuple[list[tuple[str, Choice]], list[str]]:  # fmt: skip
    """The naive schedules at equal measured cost (module docstring): of each kind the dearest
    whose overhead, measured as the rows measure theirs, is at most ``target`` (the
    controller's measured overhead); and a note for each kind that cannot get that cheap."""
    out, notes = [], []
    for kind, ladder in ladders(vuln, cost, rate, seed=seed).items():
        i, seen = matched(ladder, measure, target)
        if i < 0:
            notes.append(f"{kind}: its cheapest schedule measured {seen[0]:+.1%}, above the "
                         f"controller's {target:+.1%}: no baseline of this kind")  # fmt: skip
            continue
        name, checks = ladder[i]
        out.append((name, priced(vuln, cost, rate, checks, goal=f"{name} at {target:+.1%}")))
    return out, notes


def _row(name, kind, budget, choice: Choice, condition: Condition, vuln, cost, rate, *, steps,
         seeds, level, timing_reps) -> Row:  # fmt: skip
    t0 = time.perf_counter()
    reference = kind == "reference"  # the finite-gradient guard, no ABFT
    scaled = FaultRate(rate.value * condition.rate_scale, rate.per, rate.kinds)
    if condition.unprofiled:  # the prediction covers the profiled sites only: 0 here
        pred = Prediction(0.0, 0, 0, level)
    else:
        pred = predict(vuln, cost, scaled, choice.checks, steps, level=level)
    runs, model = [], None
    for seed in seeds:
        r, m = run(vuln, cost, rate, choice, steps=steps, seed=seed, condition=condition,
                   guard_gradients=reference)  # fmt: skip
        runs.append(r)
        model = model or m
    if reference:
        overhead = gradient_guard_overhead(vuln, reps=timing_reps, seed=seeds[0])
    else:
        overhead = measure_overhead(vuln, model, choice, reps=timing_reps, seed=seeds[0])
    return Row(name, kind, budget, choice.checks, condition, steps, tuple(runs), pred, overhead,
               choice.overhead, time.perf_counter() - t0)  # fmt: skip


def validate(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    budgets: list[float],
    *,
    seeds: int = 5,
    steps: int = 200,
    level: float = 0.9,
    at: float | None = None,
    held_out: tuple[Condition, ...] = HELD_OUT,
    with_baselines: bool = True,
    timing_reps: int = 9,
    seed: int = 0,
    verify: bool = False,
    progress: bool = False,
    on_row: Callable[[Validation], object] | None = None,
) -> Validation:
    """Every row of the module docstring: no check and each budget's choice (in-sample); the
    naive baselines and the ``held_out`` conditions at budget ``at`` (default: the middle of
    ``budgets``), ``seeds`` seeds each; ``verify``: each budget's choice is the one ``plan
    --verify`` ships (:func:`~attnchecker.adaptive.controller.fit_measured`). ``on_row`` gets
    the rows so far after each row (the CLI writes its report then: a run cut short keeps
    them). Every fault plan is drawn first, so one the injector would refuse stops the run
    before any training."""
    from attnchecker.inject.campaign import Progress

    if seeds < 1 or not budgets:
        raise ConfigError("validate needs at least one seed and one budget")
    choices, notes = {}, []

    def timed(choice: Choice) -> Estimate:
        return overhead(vuln, choice, reps=timing_reps, seed=seed)

    for b in sorted({*budgets, *([] if at is None else [at])}):
        try:
            choices[b] = fit_measured(vuln, cost, rate, b, timed) if verify else choose(
                vuln, cost, rate, budget=b)  # fmt: skip
        except ConfigError as e:  # a budget below the cheapest check: said, not run
            notes.append(str(e))
    if not choices:
        raise ConfigError("no budget fits a check: " + "; ".join(notes))
    feasible = sorted(choices)
    at = feasible[len(feasible) // 2] if at is None else at
    if at not in choices:
        raise ConfigError(f"the baselines' budget {at:.0%} fits no check: {notes[0]}")
    Planned = tuple[str, str, float | None, Choice, Condition]
    in_sample: list[Planned] = [
        ("none", "in-sample", None, priced(vuln, cost, rate, (), goal="none"), Condition()),
        *(
            (f"budget {b:.0%}" + " (verified)" * verify, "in-sample", b, choices[b], Condition())
            for b in feasible
        ),
    ]
    held: list[Planned] = [(f"{c.name} at {at:.0%}", "held-out", at, choices[at], c)
                           for c in held_out]  # fmt: skip
    runs = [seed + i for i in range(seeds)]
    for condition in {Condition(), *held_out}:  # every plan drawn (and validated) up front
        for s in runs:
            plan(vuln, cost, rate, steps, s, condition)
    rows: list[Row] = []
    kw = dict(steps=steps, seeds=runs, level=level, timing_reps=timing_reps)
    kinds = len(ladders(vuln, cost, rate)) if with_baselines else 0

    def run_rows(planned: list[Planned], advance) -> None:
        for name, kind, budget, choice, condition in planned:
            rows.append(_row(name, kind, budget, choice, condition, vuln, cost, rate, **kw))
            if on_row is not None:
                on_row(Validation(tuple(rows), (), level, tuple(notes)))
            advance()

    reference: list[Planned] = [
        ("no ABFT: skip updates with non-finite gradients", "reference", None, in_sample[0][3],
         Condition("reference", judged=False)),
    ] if with_baselines else []  # fmt: skip
    with Progress(len(in_sample) + len(reference) + kinds + len(held), progress) as advance:
        run_rows(in_sample + reference, advance)
        mine = next(r for r in rows if r.kind == "in-sample" and r.budget == at)
        if with_baselines:  # at the overhead the controller's choice measured
            target = mine.overhead.point

            def measure(checks: Checks) -> float:
                return timed(priced(vuln, cost, rate, checks, goal="a baseline's cost")).point

            base, missing = baselines(vuln, cost, rate, target, measure, seed=seed)
            notes += missing
            run_rows([(f"{n} ~ {target:+.0%} measured", "baseline", None, c, Condition())
                      for n, c in base], advance)  # fmt: skip
            for _ in range(kinds - len(base)):
                advance()
        run_rows(held, advance)
    gains = tuple(
        Gain(r.name, tuple(b.events - c.events for b, c in zip(r.runs, mine.runs, strict=True)))
        for r in rows
        if r.kind == "baseline"
    )
    return Validation(tuple(rows), gains, level, tuple(notes))
