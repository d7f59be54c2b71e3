"""Check the pricing's claims so that they can fail: ``attnchecker validate --pricing``.

Each *row* is one option (:data:`~attnchecker.adaptive.price.OPTIONS`: no protection, the
finite-gradient guard skipping or replaying, ABFT skipping or replaying) trained under sampled
faults (:func:`~attnchecker.adaptive.simulate.plan`: every site gets Poisson faults by its work,
kinds and patterns as the campaign drew them) for several seeds, each its own fault plan and the
same plans in every row (paired), in the campaign's setting and under held-out conditions (another
init seed, Shakespeare text, a trained checkpoint, other fault patterns, twice the rate).

What a run counts, as the user would: steps *replayed* (a clean replay), *skipped* updates,
*non-trainable* events (a non-finite loss or parameter: the run goes back three steps, as
``validate`` does), steps whose faults protection *corrected* in place, and whether the run went
away from its fault-free twin (the same option, seed and data without faults) as a campaign trial
calls a silent deviation: a step's loss more than :data:`LOSS_TOL` away (relative), or a
parameter more than the learning rate away at the end (absolute; the parameters' relative L2
distance is reported beside). Only the replaying options keep the fault-free trajectory
otherwise: the others go away from the twin by their skipped updates or the steps a
non-trainable event undid, so their deviation is reported, not judged. Rounding alone can meet
that criterion over a long run on real text: each twin has a *control*, the same fault-free run
with another thread count (another reduction order: only the rounding differs), and a seed whose
control meets the criterion cannot tell a silent deviation from rounding: its runs are left out
of the deviation count (reported as such), and the prediction is for the seeds that remain.

The prediction of each count is a predictive interval at ``level``: each bootstrap draw of the
campaign's outcome shares (:func:`~attnchecker.adaptive.price.shares`, the draws ``plan``'s
intervals come from) gives the mean ``steps * f * P(outcome)`` (f: faults per step at the
profiled sites): a step has a fault of outcome o with probability ``1 - exp(-f P(o))``, a run's
count is binomial over its steps, and the interval is the counts' quantiles; a run deviates with
probability ``1 - exp(-steps f P(sdc))`` and the number of deviated runs is binomial. A row's
counts miss when fewer fall inside than the level allows (one-sided binomial test at 5%), as in
:mod:`attnchecker.adaptive.validate`. Faults of one step are taken as independent: a replay
also clears the step's other transient faults (a finite one included), so at rates where steps
often carry two faults the counts of silent deviations fall below the prediction.

Overhead: each option's clean step is timed against the plain model (alternated, as ``bench``
times it) and set against the cost profile's interval: a cost profile that hides a cost (a
probe with ABFT twenty times cheaper) makes the row miss ABOVE.

Exit status (:attr:`PricingCheck.status`): 0 when nothing misses, 1 when a count or an overhead
is above its claim, 3 when the only misses are below.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnchecker.adaptive.controller import FaultRate
from attnchecker.adaptive.price import OPTIONS, Option, shares
from attnchecker.adaptive.profile import ENGINE, CostProfile, Estimate, VulnerabilityProfile
from attnchecker.adaptive.simulate import Condition, _batches, _finite, model_for, plan
from attnchecker.adaptive.validate import binomial_miss
from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import ConfigError
from attnchecker.inject.trial import USER_OUTCOMES

__all__ = ["COUNTED", "HELD_OUT", "LOSS_TOL", "PricingCheck", "PricingRow", "check_pricing",
           "run_option"]  # fmt: skip

IN_SAMPLE = Condition()


def _control_threads() -> int:
    """The control's thread count: another than the twin's, so another reduction order."""
    return 1 if torch.get_num_threads() > 1 else 2


COUNTED = ("replayed", "skipped", "non_trainable", "corrected")  # counted per run
LOSS_TOL = 1e-5  # a step's loss this far from the twin's (relative): a silent deviation
HELD_OUT = (
    Condition("init seed 7", model_seed=7),
    Condition("Shakespeare text", data="shakespeare"),
    Condition("checkpoint after 300 clean steps", pretrain=300),
    Condition("patterns 1R / 1C / 2D", patterns=("1R", "1C", "2D")),
    Condition("rate x 2", rate_scale=2.0),
)


@dataclass(frozen=True)
class OptionRun:
    """One simulated run of an option: its faults, its counts, its distance to its twin."""

    seed: int
    faults: int
    counts: dict[str, int]
    distance: float  # the parameters' relative L2 distance to the twin at the end
    deviated: bool = False
    judged: bool = True  # False: rounding alone (the control) meets the criterion here


def _protected(option: Option) -> bool:
    return option.arm.startswith("protected")


def _replays(option: Option) -> bool:
    return option.name.endswith("replay")


def run_option(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, option: Option,
               *, steps: int, seed: int, condition: Condition = IN_SAMPLE,
               faults: bool = True, threads: int | None = None,
               ) -> tuple[OptionRun, list, list[float]]:  # fmt: skip
    """Train ``steps`` steps of ``option`` under :func:`plan`'s faults (``faults=False``: none,
    the twin; ``threads``: with that many, the control); (its run, its final parameters, its
    losses: NaN where the update was skipped)."""
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return run_option(vuln, cost, rate, option, steps=steps, seed=seed,
                              condition=condition, faults=faults)  # fmt: skip
        finally:
            torch.set_num_threads(before)
    from attnchecker.inject.injector import Injector
    from attnchecker.inject.plan import FaultPlan
    from attnchecker.models import source
    from attnchecker.models.protect import protect_
    from attnchecker.recovery.replay import Replayer

    setup = vuln.setup
    B, L, lr = setup.get("batch", 4), setup.get("seq_len", 32), setup.get("lr", 1e-3)
    model = model_for(vuln, condition, seed)
    data = _batches(condition.data, B, L, seed + 1)
    first = next(data)
    handle = None
    if _protected(option):
        policy = "replay" if _replays(option) else "skip_step"
        config = ABFTConfig(policy=policy, backend=ENGINE)
        handle = protect_(model, config, example=source.example(model, first))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stepper = Replayer(opt, handle, replay=_replays(option))
    sampled = plan(vuln, cost, rate, steps, seed, condition) if faults else FaultPlan(())
    counts: Counter[str] = Counter()
    losses: list[float] = []
    data = itertools.chain([first], data)
    ring: list[tuple[dict, dict]] = []
    step = 0
    torch.manual_seed(seed)  # dropout: the twin draws the same masks
    with Injector(model, sampled, step_fn=lambda: step), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):  # noqa: B007 (the injector reads it)
            now = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            ring = [*ring[-2:], now]
            ids = next(data)

            def closure(ids=ids) -> torch.Tensor:
                loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
                loss.backward()
                return loss

            if option.cost is None:  # no protection, no guard
                loss, skipped, replayed = closure(), False, False
                opt.step()
                events = []
            else:  # the guard, with protection's flag: replaying or skipping
                out = stepper.step(closure)
                loss, skipped, replayed, events = out.loss, out.skipped, out.replayed, out.events
            opt.zero_grad(set_to_none=True)
            losses.append(math.nan if skipped else float(loss.detach()))
            counts["skipped"] += skipped
            counts["replayed"] += replayed and not skipped
            fixed = any(e.action in ("corrected", "recomputed") for e in events)
            counts["corrected"] += fixed and not (skipped or replayed)
            if not _finite(None if skipped else loss.detach(), model):
                counts["non_trainable"] += 1
                params, state = ring[0]
                model.load_state_dict(params)
                opt.load_state_dict(copy.deepcopy(state))
                ring = ring[:1]
    final = [p.detach().clone() for p in model.parameters()]
    run = OptionRun(seed, len(sampled.faults), {k: counts[k] for k in COUNTED}, math.nan)
    return run, final, losses


def _against(run: OptionRun, final, losses, twin, lr: float, judged: bool = True) -> OptionRun:
    """``run`` with its distance to its twin ((final parameters, losses)) and whether it
    deviated silently (module docstring); ``judged``: whether its seed can tell."""
    theirs, their_losses = twin
    diff = sum(float((x.double() - y.double()).square().sum())
               for x, y in zip(final, theirs, strict=True))  # fmt: skip
    norm = sum(float(y.double().square().sum()) for y in theirs)
    drift = max(float((x - y).abs().max()) for x, y in zip(final, theirs, strict=True))
    steps = [(a, b) for a, b in zip(losses, their_losses, strict=True) if not math.isnan(a)]
    off = any(not abs(a - b) <= LOSS_TOL * max(abs(b), 1e-12) for a, b in steps)
    return OptionRun(run.seed, run.faults, run.counts, math.sqrt(diff / max(norm, 1e-300)),
                     off or not drift <= lr, judged)  # fmt: skip


@dataclass(frozen=True)
class Interval:
    mean: float
    low: int
    high: int


@dataclass(frozen=True)
class PricingRow:
    """One option under one condition, its runs against the predictions."""

    option: str
    condition: Condition
    steps: int
    runs: tuple[OptionRun, ...]
    predicted: dict[str, Interval]  # per counted outcome
    deviated: Interval | None  # runs that deviated (None: not judged, a skipping option)
    overhead: Estimate
    predicted_overhead: Estimate
    level: float

    def inside(self, outcome: str) -> int:
        p = self.predicted[outcome]
        return sum(p.low <= r.counts[outcome] <= p.high for r in self.runs)

    def misses(self) -> list[str]:
        out = []
        for o in COUNTED:
            inside, n = self.inside(o), len(self.runs)
            if binomial_miss(inside, n, self.level):
                p = self.predicted[o]
                above = sum(r.counts[o] > p.high for r in self.runs)
                side = "ABOVE" if 2 * above >= n - inside else "BELOW"
                out.append(f"{self.name}: {o} {side} the {self.level:.0%} interval [{p.low}, "
                           f"{p.high}] ({[r.counts[o] for r in self.runs]})")  # fmt: skip
        if self.deviated is not None:
            k = sum(r.deviated for r in self.runs if r.judged)
            if not self.deviated.low <= k <= self.deviated.high:
                side = "ABOVE" if k > self.deviated.high else "BELOW"
                n = sum(r.judged for r in self.runs)
                out.append(f"{self.name}: {k} of {n} runs deviated silently, {side} the "
                           f"interval [{self.deviated.low}, {self.deviated.high}]")  # fmt: skip
        o, q = self.overhead.point, self.predicted_overhead
        if self.option != "none" and not q.low <= o <= q.high:
            side = "ABOVE" if o > q.high else "BELOW"
            out.append(f"{self.name}: overhead {o:+.1%} {side} the cost profile's [{q.low:+.1%}, "
                       f"{q.high:+.1%}]")  # fmt: skip
        return out

    @property
    def name(self) -> str:
        return f"{self.option} ({self.condition.name})"

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "condition": self.condition.to_dict(),
                "steps": self.steps, "runs": [vars(r) | {"deviated": r.deviated}
                                              for r in self.runs],
                "predicted": {k: vars(v) for k, v in self.predicted.items()},
                "deviated": None if self.deviated is None else vars(self.deviated),
                "overhead": self.overhead, "predicted_overhead": self.predicted_overhead,
                "misses": self.misses()}  # fmt: skip


@dataclass(frozen=True)
class PricingCheck:
    rows: tuple[PricingRow, ...]
    level: float
    notes: tuple[str, ...] = field(default=())

    def misses(self) -> list[str]:
        return [m for r in self.rows for m in r.misses()]

    @property
    def status(self) -> int:
        misses = self.misses()
        if any("ABOVE" in m for m in misses):
            return 1
        return 3 if misses else 0

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "rows": [r.to_dict() for r in self.rows],
                "misses": self.misses(), "status": self.status,
                "notes": list(self.notes)}  # fmt: skip

    def lines(self) -> list[str]:
        head = ("| option | condition | faults per run | " + " | ".join(
            f"{o} per run [predicted]" for o in COUNTED) + " | deviated runs [predicted] | "
            "overhead [cost profile] |")  # fmt: skip
        out = [head, "|" + "---|" * (5 + len(COUNTED))]
        for r in self.rows:
            cells = [f"{', '.join(str(x.counts[o]) for x in r.runs)} "
                     f"[{r.predicted[o].low}, {r.predicted[o].high}]" for o in COUNTED]  # fmt: skip
            judged = [x for x in r.runs if x.judged]
            k = sum(x.deviated for x in judged)
            left = len(r.runs) - len(judged)
            every = f"{sum(x.deviated for x in r.runs)} of {len(r.runs)} (not judged)"
            dev = (f"{k} of {len(judged)} [{r.deviated.low}, {r.deviated.high}]"
                   + (f" ({left} left out: rounding alone meets it)" if left else "")
                   if r.deviated is not None else every)  # fmt: skip
            q, per_run = r.predicted_overhead, sum(x.faults for x in r.runs) / len(r.runs)
            ours = f"{r.overhead.point:+.1%} [{q.low:+.1%}, {q.high:+.1%}]"
            out.append(f"| {r.option} | {r.condition.name} | {per_run:.1f} | "
                       f"{' | '.join(cells)} | {dev} | {ours} |")  # fmt: skip
        misses = self.misses()
        out += ["", *(f"Note: {n}." for n in self.notes), "",
                f"**Misses: {len(misses)}** (exit status {self.status})"]  # fmt: skip
        return out + [f"- {m}" for m in misses]


def _ends(x: torch.Tensor, level: float) -> tuple[int, int]:
    return (int(torch.quantile(x, (1 - level) / 2, interpolation="lower")),
            int(torch.quantile(x, (1 + level) / 2, interpolation="higher")))  # fmt: skip


def _predict(
    share: torch.Tensor,
    mean_faults: float,
    steps: int,
    seeds: int,
    level: float,
    judged_deviation: bool,
    seed: int,
) -> tuple[dict[str, Interval], Interval | None]:
    """The predictive intervals of one row (module docstring); ``share``: (draws + 1, outcomes)
    of the option's arm at the profiled sites."""
    g = torch.Generator().manual_seed(seed)
    draws = share[1:]
    out = {}
    for o in COUNTED:  # steps with at least one fault of outcome o
        p = 1 - torch.exp(-mean_faults * draws[:, USER_OUTCOMES.index(o)])
        counts = torch.binomial(torch.full_like(p, float(steps)), p, generator=g)
        out[o] = Interval(float(steps * p.mean()), *_ends(counts, level))
    if not judged_deviation:
        return out, None
    p = 1 - torch.exp(-steps * mean_faults * draws[:, USER_OUTCOMES.index("silent_deviation")])
    k = torch.binomial(torch.full_like(p, float(seeds)), p, generator=g)
    return out, Interval(float(seeds * p.mean()), *_ends(k, level))


def option_overhead(vuln: VulnerabilityProfile, option: Option, *, reps: int,
                    seed: int) -> Estimate:  # fmt: skip
    """An option's clean step against the plain model's (alternated, medians; the bench's
    recovery arms' measurement)."""
    from attnchecker.adaptive.bench import alternate, median_interval, replay_stepper, stepper
    from attnchecker.models import source
    from attnchecker.models.protect import protect_

    if option.cost is None:
        return Estimate(0.0, 0.0, 0.0)
    setup = vuln.setup
    B, L = setup.get("batch", 4), setup.get("seq_len", 32)
    ids = torch.randint(3, 128, (B, L), generator=torch.Generator().manual_seed(seed + 2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    base = model_for(vuln, Condition(), seed)
    plain = source.plain(copy.deepcopy(base))
    model, handle = source.plain(copy.deepcopy(base)), None
    if _protected(option):
        model = copy.deepcopy(base)
        config = ABFTConfig(policy="replay", backend=ENGINE)
        handle = protect_(model, config, example=source.example(model, ids))
    steps = {"plain": stepper(plain, plain, inputs, "fp32", "cpu"),
             "option": replay_stepper(model, inputs, "fp32", "cpu", handle)}  # fmt: skip
    for f in steps.values():
        f()
    times = alternate(steps, reps)
    return median_interval([(a - p) / p for a, p in zip(times["option"], times["plain"],
                                                          strict=True)])  # fmt: skip


def check_pricing(vuln: VulnerabilityProfile, cost: CostProfile, campaign: str | Path,
                  rate: FaultRate, *, steps: int = 60, seeds: int = 5, level: float = 0.9,
                  held_out: tuple[Condition, ...] = HELD_OUT,
                  options: tuple[str, ...] | None = None, timing_reps: int = 9, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> PricingCheck:  # fmt: skip
    """Every option under the campaign's setting and each held-out condition (module
    docstring)."""
    from attnchecker.adaptive.controller import sites

    if rate.per != "step":
        raise ConfigError("validate --pricing samples faults per step: give --per step")
    chosen = [o for o in OPTIONS if options is None or o.name in options]
    if not chosen:
        raise ConfigError(f"no option among {options}; choose from {[o.name for o in OPTIONS]}")
    share, _, _ = shares(campaign, cost, rate.kinds, seed=seed)
    mean_faults = sum(s.faults for s in sites(vuln, cost, rate))  # at the profiled sites
    overheads = {o.name: option_overhead(vuln, o, reps=timing_reps, seed=seed) for o in chosen}
    claimed = {None: Estimate(0.0, 0.0, 0.0), **cost.recovery}
    rows = []
    lr = vuln.setup.get("lr", 1e-3)  # a campaign's parameter tolerance (its default)
    for condition in (IN_SAMPLE, *held_out):
        twins: dict[tuple[bool, int], tuple] = {}
        judged: dict[tuple[bool, int], bool] = {}  # whether the seed's control stays clean
        for o in chosen:
            t0, runs = time.perf_counter(), []
            for s in range(seed, seed + seeds):
                run, final, losses = run_option(vuln, cost, rate, o, steps=steps, seed=s,
                                                condition=condition)  # fmt: skip
                key = (_protected(o), s)
                if key not in twins:
                    twins[key] = run_option(vuln, cost, rate, o, steps=steps, seed=s,
                                            condition=condition, faults=False)[1:]  # fmt: skip
                if key not in judged and _replays(o):
                    control = run_option(vuln, cost, rate, o, steps=steps, seed=s,
                                         condition=condition, faults=False,
                                         threads=_control_threads())  # fmt: skip
                    judged[key] = not _against(control[0], *control[1:], twins[key], lr).deviated
                runs.append(_against(run, final, losses, twins[key], lr, judged.get(key, True)))
            f = mean_faults * condition.rate_scale
            n = sum(r.judged for r in runs)
            predicted, dev = _predict(share[o.arm], f, steps, n, level, _replays(o),
                                      seed)  # fmt: skip
            rows.append(PricingRow(o.name, condition, steps, tuple(runs), predicted, dev,
                                   overheads[o.name], claimed.get(o.cost, claimed[None]),
                                   level))  # fmt: skip
            if progress is not None:
                progress(f"{rows[-1].name}: {time.perf_counter() - t0:.0f} s")
    notes = (f"{mean_faults:.3g} faults per step at the campaign's sites (x the condition's "
             f"rate scale)", *_crossing(campaign, cost, overheads, level))  # fmt: skip
    return PricingCheck(tuple(rows), level, notes)


def _crossing(campaign, cost: CostProfile, overheads: dict[str, Estimate],
              level: float) -> tuple[str, ...]:  # fmt: skip
    """Where ABFT with replay becomes cheaper than the guard with replay, by ``plan``'s pricing
    with the overheads measured here (default job prices)."""
    import dataclasses

    from attnchecker.adaptive.price import Job, price

    if not {"guard_replay", "abft_replay"} <= set(overheads):
        return ()
    measured = {"guard": overheads["guard_replay"], "abft": overheads["abft_replay"]}
    pricing = price(campaign, dataclasses.replace(cost, recovery=measured), FaultRate(1.0),
                    Job(cost.step_seconds), level=level)  # fmt: skip
    r = pricing.crossings.get("guard_replay", {}).get("abft_replay")
    if r is None:
        return ("ABFT with replay measured no dearer than the guard with replay here",)
    return (f"with the overheads measured here (guard {overheads['guard_replay'].point:+.1%}, "
            f"ABFT {overheads['abft_replay'].point:+.1%}) and plan's default prices, ABFT with "
            f"replay costs less than the guard with replay above {r.point:.3g} [{r.low:.3g}, "
            f"{r.high:.3g}] faults per step",)  # fmt: skip
