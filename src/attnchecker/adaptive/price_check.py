"""Check the pricing's claims so that they can fail: ``attnchecker validate --pricing``.

Each *row* is one option (:data:`~attnchecker.adaptive.price.OPTIONS`: no protection, the
finite-gradient guard skipping or replaying, ABFT skipping or replaying) trained under sampled
faults (:func:`~attnchecker.adaptive.simulate.plan`: every site gets Poisson faults by its work,
kinds and patterns as the campaign drew them) for several seeds, each its own fault plan and the
same plans in every row (paired), in the campaign's setting and under held-out conditions (another
init seed, Shakespeare text, a trained checkpoint, other fault patterns, twice the rate).

What a run counts, as the user would: steps *replayed* (a clean replay), *skipped* updates,
*non-trainable* events (a non-finite loss or parameter: the run goes back three steps, as
``validate`` does), steps whose faults protection *corrected* in place, and steps whose faults
left a *silent deviation*. A deviation is judged per faulty step as a campaign trial judges its
fault: from the state the run had before that step (parameters, optimizer, random state, the
checks' clock), the step's faults and the campaign's horizon of clean steps after them (its
``steps``) are trained twice, with the faults and without, through the option's own step; the
faulty fork deviated when it skipped no update, stayed finite, and a step's loss is more than
:data:`LOSS_TOL` away (relative) or a parameter more than the learning rate away at the end
(absolute). Both forks start from the same state on the same thread count, so only the fault
separates them (a whole-run comparison with a fault-free twin could not tell a deviation from
rounding that grew over the run). The forks' parameter distances are reported beside.

The prediction of each count is a predictive interval at ``level``: each bootstrap draw of the
campaign's outcome shares (:func:`~attnchecker.adaptive.price.shares`, the draws ``plan``'s
intervals come from) gives the mean ``steps * f * P(outcome)`` (f: faults per step at the
profiled sites): a step has a fault of outcome o with probability ``1 - exp(-f P(outcome))``, a
run's count is binomial over its steps, and the interval is the counts' quantiles. A row's
counts miss when fewer fall inside than the level allows (one-sided binomial test at 5%), as in
:mod:`attnchecker.adaptive.validate`. Faults of one step are taken as independent: a replay
also clears the step's other transient faults (a finite one included), so at rates where steps
often carry two faults the counts of silent deviations fall below the prediction.

Overhead: each option's clean step is timed against the plain model (alternated, as ``bench``
times it) and set against the cost profile's interval: a cost profile that hides a cost (a
probe with ABFT twenty times cheaper) makes the row miss ABOVE.

Baselines at equal measured cost (``budget``): ``plan --budget``'s schedule, priced as a
mixture (ABFT where it checks, the guard with replay elsewhere), against the naive schedules of
:func:`~attnchecker.adaptive.validate.baselines` (every check every k steps, the forward's
checks only, a random subset) whose overhead, measured as the schedule's, is at most the
schedule's; each run as a mixture, in the campaign's setting, its counts predicted from the same
draws. The schedule's gain over each is the paired difference of the seeds' steps lost, priced
as ``plan`` prices them (:class:`~attnchecker.adaptive.price.Job`'s defaults at the cost
profile's step time), with a t interval: reported, not judged.

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
from attnchecker.adaptive.price import OPTIONS, Job, Mixture, Option, shares
from attnchecker.adaptive.profile import ENGINE, CostProfile, Estimate, VulnerabilityProfile
from attnchecker.adaptive.simulate import Condition, _batches, _finite, model_for, plan
from attnchecker.adaptive.validate import Gain, binomial_miss
from attnchecker.attention.config import ABFTConfig
from attnchecker.errors import ConfigError
from attnchecker.inject.campaign import CampaignConfig
from attnchecker.inject.trial import USER_OUTCOMES, departed, param_distance

__all__ = ["COUNTED", "HELD_OUT", "LOSS_TOL", "PricingCheck", "PricingRow", "check_pricing",
           "deviates", "run_option"]  # fmt: skip

IN_SAMPLE = Condition()
COUNTED = ("replayed", "skipped", "non_trainable", "corrected", "silent_deviation")  # per run
LOSS_TOL = CampaignConfig.tolerance  # a loss this far from the clean fork's (relative): deviated
HELD_OUT = (
    Condition("init seed 7", model_seed=7),
    Condition("Shakespeare text", data="shakespeare"),
    Condition("checkpoint after 300 clean steps", pretrain=300),
    Condition("patterns 1R / 1C / 2D", patterns=("1R", "1C", "2D")),
    Condition("rate x 2", rate_scale=2.0),
)
Checks = tuple[tuple[int, str, int], ...]


@dataclass(frozen=True)
class OptionRun:
    """One simulated run of an option: its faults, its counts, the parameter distances of its
    silent deviations (the faulty fork's relative L2 distance to the fault-free one)."""

    seed: int
    faults: int
    counts: dict[str, int]
    distances: tuple[float, ...] = ()


def _protected(option: Option) -> bool:
    return option.arm.startswith("protected")


def _replays(option: Option) -> bool:
    return option.name.endswith("replay")


def _config(option: Option | None, checks: Checks | None) -> ABFTConfig | None:
    """The protection an option runs: a mixture's schedule (``checks``) with replay, the
    default checks, or none (the guard alone, or nothing)."""
    if checks is not None:
        return ABFTConfig(schedule=checks, policy="replay", backend=ENGINE)
    if _protected(option):
        return ABFTConfig(policy="replay" if _replays(option) else "skip_step", backend=ENGINE)
    return None


def run_option(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, option: Option,
               *, steps: int, seed: int, condition: Condition = IN_SAMPLE,
               checks: Checks | None = None) -> OptionRun:  # fmt: skip
    """Train ``steps`` steps of ``option`` (``checks``: a mixture's schedule) under
    :func:`plan`'s faults, counting its outcomes; each faulty step is then forked to judge
    its silent deviation (module docstring)."""
    from attnchecker.inject.injector import Injector
    from attnchecker.models import source
    from attnchecker.models.protect import protect_
    from attnchecker.recovery.replay import RandomState, Replayer

    setup = vuln.setup
    B, L, lr = setup.get("batch", 4), setup.get("seq_len", 32), setup.get("lr", 1e-3)
    horizon = setup.get("steps", 3)  # a campaign trial's steps: the fault's and those after
    model = model_for(vuln, condition, seed)
    batches = list(itertools.islice(_batches(condition.data, B, L, seed + 1), steps + horizon))
    config, handle = _config(option, checks), None
    if config is not None:
        handle = protect_(model, config, example=source.example(model, batches[0]))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    stepper = Replayer(opt, handle, replay=_replays(option) or checks is not None)
    sampled = plan(vuln, cost, rate, steps, seed, condition)
    faulty = {f.step for f in sampled.faults}

    def one(ids: torch.Tensor) -> tuple[torch.Tensor, bool, bool, list]:
        """One step of the option: (loss, skipped, replayed, protection's events)."""

        def closure() -> torch.Tensor:
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            return loss

        if option.cost is None and checks is None:  # no protection, no guard
            loss = closure()
            opt.step()
            out = (loss, False, False, [])
        else:  # the guard, with protection's flag: replaying or skipping
            r = stepper.step(closure)
            out = (r.loss, r.skipped, r.replayed, r.events)
        opt.zero_grad(set_to_none=True)
        return out

    def state() -> tuple:
        mark = None if handle is None else handle.mark()
        return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                RandomState.capture(), mark)  # fmt: skip

    def restore(saved: tuple) -> None:
        params, opt_state, rng, mark = saved
        model.load_state_dict(params)
        opt.load_state_dict(copy.deepcopy(opt_state))
        rng.restore()
        if mark is not None:
            handle.rewind(mark)

    counts: Counter[str] = Counter()
    ring: list[tuple] = []
    forks: dict[int, tuple] = {}
    step = 0
    torch.manual_seed(seed)  # dropout
    with Injector(model, sampled, step_fn=lambda: step), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(1, steps + 1):
            now = state()
            ring = [*ring[-2:], now]
            if step in faulty:
                forks[step] = now
            loss, skipped, replayed, events = one(batches[step - 1])
            counts["skipped"] += skipped
            counts["replayed"] += replayed and not skipped
            fixed = any(e.action in ("corrected", "recomputed") for e in events)
            counts["corrected"] += fixed and not (skipped or replayed)
            if not _finite(None if skipped else loss.detach(), model):
                counts["non_trainable"] += 1
                restore(ring[0])
                ring = ring[:1]

    def fork(at: int, saved: tuple, with_faults: bool) -> tuple[list[float], list, bool]:
        """``horizon`` steps from ``saved`` (the state before step ``at``), with that step's
        faults or none: (losses, final parameters, whether it skipped or went non-finite)."""
        from attnchecker.inject.plan import FaultPlan

        restore(saved)
        mine = FaultPlan(tuple(f for f in sampled.faults if f.step == at) if with_faults else ())
        losses, lost, t = [], False, at
        with Injector(model, mine, step_fn=lambda: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t in range(at, at + horizon):
                loss, skipped, _, _ = one(batches[t - 1])
                losses.append(float(loss.detach()))
                lost |= skipped or not _finite(None if skipped else loss.detach(), model)
        return losses, [p.detach().clone() for p in model.parameters()], lost

    distances = []
    for at, saved in sorted(forks.items()):
        ours, mine, lost = fork(at, saved, True)
        theirs, clean, _ = fork(at, saved, False)
        if lost:  # skipped or non-trainable: counted above, not a silent deviation
            continue
        if deviates(ours, theirs, mine, clean, lr):
            counts["silent_deviation"] += 1
            distances.append(param_distance(mine, clean))
    return OptionRun(seed, len(sampled.faults), {k: counts[k] for k in COUNTED}, tuple(distances))


def deviates(losses: list[float], clean_losses: list[float], params: list, clean: list,
             lr: float) -> bool:  # fmt: skip
    """A campaign trial's criterion (:func:`~attnchecker.inject.trial.departed`): a step's loss
    more than :data:`LOSS_TOL` from the clean fork's (relative), or a parameter more than ``lr``
    from its value there (absolute)."""
    drift = max(float((x - y).abs().max()) for x, y in zip(params, clean, strict=True))
    return departed(list(zip(losses, clean_losses, strict=True)), drift, LOSS_TOL, lr)


@dataclass(frozen=True)
class Interval:
    mean: float
    low: int
    high: int


@dataclass(frozen=True)
class PricingRow:
    """One option (or a mixture) under one condition, its runs against the predictions."""

    option: str
    condition: Condition
    steps: int
    runs: tuple[OptionRun, ...]
    predicted: dict[str, Interval]  # per counted outcome
    overhead: Estimate
    predicted_overhead: Estimate
    level: float
    checks: Checks | None = None  # a mixture's schedule

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
        o, q = self.overhead.point, self.predicted_overhead
        if self.option != "none" and not q.low <= o <= q.high:
            side = "ABOVE" if o > q.high else "BELOW"
            out.append(f"{self.name}: overhead {o:+.1%} {side} the cost profile's [{q.low:+.1%}, "
                       f"{q.high:+.1%}]")  # fmt: skip
        return out

    @property
    def name(self) -> str:
        return f"{self.option} ({self.condition.name})"

    def lost(self, job: Job) -> list[float]:
        """Each run's steps lost, priced as ``plan`` prices its outcomes for ``job``."""
        prices = job.prices()
        return [sum(r.counts[o] * prices[o] for o in COUNTED) for r in self.runs]

    def to_dict(self) -> dict[str, Any]:
        return {"option": self.option, "condition": self.condition.to_dict(),
                "steps": self.steps, "checks": self.checks, "runs": [vars(r) for r in self.runs],
                "predicted": {k: vars(v) for k, v in self.predicted.items()},
                "overhead": self.overhead, "predicted_overhead": self.predicted_overhead,
                "misses": self.misses()}  # fmt: skip


@dataclass(frozen=True)
class PricingCheck:
    rows: tuple[PricingRow, ...]
    level: float
    notes: tuple[str, ...] = field(default=())
    gains: tuple[Gain, ...] = ()  # the plan's schedule over each naive one (steps lost)

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
                "gains": [g.to_dict() for g in self.gains], "misses": self.misses(),
                "status": self.status, "notes": list(self.notes)}  # fmt: skip

    def lines(self) -> list[str]:
        head = (
            "| option | condition | faults per run | "
            + " | ".join(f"{o} per run [predicted]" for o in COUNTED)
            + " | overhead [cost profile] |"
        )
        out = [head, "|" + "---|" * (4 + len(COUNTED))]
        for r in self.rows:
            cells = [f"{', '.join(str(x.counts[o]) for x in r.runs)} "
                     f"[{r.predicted[o].low}, {r.predicted[o].high}]" for o in COUNTED]  # fmt: skip
            q, per_run = r.predicted_overhead, sum(x.faults for x in r.runs) / len(r.runs)
            ours = f"{r.overhead.point:+.1%} [{q.low:+.1%}, {q.high:+.1%}]"
            out.append(f"| {r.option} | {r.condition.name} | {per_run:.1f} | "
                       f"{' | '.join(cells)} | {ours} |")  # fmt: skip
        if self.gains:
            out += ["", "| the plan's schedule against | steps lost per run, baseline minus "
                    "schedule (> 0: the schedule lost fewer) | mean [95% t interval] |",
                    "|---|---|---|"]  # fmt: skip
            for g in self.gains:
                m = g.mean
                out.append(f"| {g.baseline} | {', '.join(f'{d:.0f}' for d in g.differences)} | "
                           f"{m.point:.0f} [{m.low:.0f}, {m.high:.0f}] |")  # fmt: skip
        misses = self.misses()
        out += ["", *(f"Note: {n}." for n in self.notes), "",
                f"**Misses: {len(misses)}** (exit status {self.status})"]  # fmt: skip
        return out + [f"- {m}" for m in misses]


def _ends(x: torch.Tensor, level: float) -> tuple[int, int]:
    return (int(torch.quantile(x, (1 - level) / 2, interpolation="lower")),
            int(torch.quantile(x, (1 + level) / 2, interpolation="higher")))  # fmt: skip


def _predict(share: torch.Tensor, mean_faults: float, steps: int, level: float,
             seed: int) -> dict[str, Interval]:  # fmt: skip
    """The predictive intervals of one row (module docstring); ``share``: (draws + 1, outcomes)
    of the option's arm at the profiled sites."""
    g = torch.Generator().manual_seed(seed)
    draws = share[1:]
    out = {}
    for o in COUNTED:  # steps with at least one fault of outcome o
        p = 1 - torch.exp(-mean_faults * draws[:, USER_OUTCOMES.index(o)])
        counts = torch.binomial(torch.full_like(p, float(steps)), p, generator=g)
        out[o] = Interval(float(steps * p.mean()), *_ends(counts, level))
    return out


def option_overhead(vuln: VulnerabilityProfile, option: Option | None, *, reps: int, seed: int,
                    checks: Checks | None = None) -> Estimate:  # fmt: skip
    """An option's clean step (``option`` None: a mixture's, ``checks``, whole periods per
    round) against the plain model's (alternated, medians; the bench's recovery arms'
    measurement)."""
    from attnchecker.adaptive.bench import PER_ROUND, alternate, median_interval, replay_stepper
    from attnchecker.adaptive.bench import stepper as plain_stepper
    from attnchecker.models import source
    from attnchecker.models.protect import protect_

    if checks is None and option.cost is None:
        return Estimate(0.0, 0.0, 0.0)
    setup = vuln.setup
    B, L = setup.get("batch", 4), setup.get("seq_len", 32)
    ids = torch.randint(3, 128, (B, L), generator=torch.Generator().manual_seed(seed + 2))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    base = model_for(vuln, Condition(), seed)
    plain = source.plain(copy.deepcopy(base))
    model, handle = source.plain(copy.deepcopy(base)), None
    config = _config(option, checks)
    if config is not None:
        model = copy.deepcopy(base)
        handle = protect_(model, config.replace(policy="replay"),
                          example=source.example(model, ids))  # fmt: skip
    steps = {"plain": plain_stepper(plain, plain, inputs, "fp32", "cpu"),
             "option": replay_stepper(model, inputs, "fp32", "cpu", handle)}  # fmt: skip
    for f in steps.values():
        f()
    period = 1 if config is None else max(1, config.period)
    times = alternate(steps, reps, period * math.ceil(PER_ROUND / period))
    return median_interval([(a - p) / p for a, p in zip(times["option"], times["plain"],
                                                          strict=True)])  # fmt: skip


def _rows(vuln, cost, rate, planned, share, mean_faults, *, steps, seeds, level, seed,
          progress) -> list[PricingRow]:  # fmt: skip
    """Each planned row (option, condition, measured overhead, claimed overhead, checks) run
    for ``seeds`` seeds and set against its prediction."""
    rows = []
    for o, condition, overhead, claimed, checks in planned:
        t0 = time.perf_counter()
        runs = tuple(run_option(vuln, cost, rate, o, steps=steps, seed=s, condition=condition,
                                checks=checks) for s in range(seed, seed + seeds))  # fmt: skip
        predicted = _predict(share[o.name if checks is not None else o.arm],
                             mean_faults * condition.rate_scale, steps, level, seed)  # fmt: skip
        rows.append(PricingRow(o.name, condition, steps, runs, predicted, overhead, claimed,
                               level, checks))  # fmt: skip
        if progress is not None:
            progress(f"{rows[-1].name}: {time.perf_counter() - t0:.0f} s")
    return rows


def check_pricing(vuln: VulnerabilityProfile, cost: CostProfile, campaign: str | Path,
                  rate: FaultRate, *, steps: int = 60, seeds: int = 5, level: float = 0.9,
                  held_out: tuple[Condition, ...] = HELD_OUT,
                  options: tuple[str, ...] | None = None, budget: float | None = None,
                  timing_reps: int = 9, seed: int = 0,
                  progress: Callable[[str], None] | None = None) -> PricingCheck:  # fmt: skip
    """Every option under the campaign's setting and each held-out condition; with ``budget``,
    ``plan --budget``'s schedule against naive ones at its measured cost (module docstring)."""
    from attnchecker.adaptive.controller import choose, sites

    if rate.per != "step":
        raise ConfigError("validate --pricing samples faults per step: give --per step")
    chosen = [o for o in OPTIONS if options is None or o.name in options]
    if not chosen:
        raise ConfigError(f"no option among {options}; choose from {[o.name for o in OPTIONS]}")
    for condition in (IN_SAMPLE, *held_out):  # every plan drawn (and validated) up front
        for s in range(seed, seed + seeds):
            plan(vuln, cost, rate, steps, s, condition)
    mean_faults = sum(s.faults for s in sites(vuln, cost, rate))  # at the profiled sites
    mixtures: list[Mixture] = []
    notes: list[str] = []
    if budget is not None:  # the plan's schedule and the naive ones at its measured cost
        mine = choose(vuln, cost, rate, budget=budget, policy="replay")
        mixtures = [_mixture(vuln, f"plan at {budget:.0%}", mine, timing_reps, seed)]
        mixtures += _naive(vuln, cost, rate, mixtures[0].overhead.point, timing_reps, seed, notes)
    share, _, _ = shares(campaign, cost, rate.kinds, mixtures=tuple(mixtures), seed=seed)
    overheads = {o.name: option_overhead(vuln, o, reps=timing_reps, seed=seed) for o in chosen}
    claimed = {None: Estimate(0.0, 0.0, 0.0), **cost.recovery}
    planned = [(o, c, overheads[o.name], claimed.get(o.cost, claimed[None]), None)
               for c in (IN_SAMPLE, *held_out) for o in chosen]  # fmt: skip
    planned += [
        (m.option, IN_SAMPLE, m.overhead, claim, m.checks)
        for m, claim in zip(mixtures, _claims(vuln, cost, rate, mixtures), strict=True)
    ]
    rows = _rows(vuln, cost, rate, planned, share, mean_faults, steps=steps, seeds=seeds,
                 level=level, seed=seed, progress=progress)  # fmt: skip
    job = Job(cost.step_seconds)
    gains = ()
    if mixtures:
        ours = rows[len(planned) - len(mixtures)]
        gains = tuple(Gain(r.option, tuple(b - a for a, b in zip(ours.lost(job), r.lost(job),
                                                                  strict=True)))
                      for r in rows[len(planned) - len(mixtures) + 1:])  # fmt: skip
        notes.append(f"steps lost priced as plan prices them at this step time "
                     f"({cost.step_seconds * 1e3:.0f} ms): a replay or a skip 1, a restart or a "
                     f"silent deviation {job.restart_steps:.0f}")  # fmt: skip
    notes = [f"{mean_faults:.3g} faults per step at the campaign's sites (x the condition's "
             f"rate scale)", *notes, *_crossing(campaign, cost, overheads, level)]  # fmt: skip
    return PricingCheck(tuple(rows), level, tuple(notes), gains)


def _mixture(vuln, name: str, choice, reps: int, seed: int) -> Mixture:
    """A schedule as a mixture, with its overhead measured as the options' are."""
    over = option_overhead(vuln, None, reps=reps, seed=seed, checks=choice.checks)
    return Mixture(name, f"{name} ({len(choice.checks)} checks) with replay", choice.checks, over)


def _naive(vuln, cost, rate, target: float, reps: int, seed: int,
           notes: list[str]) -> list[Mixture]:  # fmt: skip
    """The naive schedules whose measured overhead is at most ``target`` (the plan's), as
    mixtures; a note for each kind that cannot get that cheap."""
    from attnchecker.adaptive.validate import baselines

    def measure(checks: Checks) -> float:
        return option_overhead(vuln, None, reps=reps, seed=seed, checks=checks).point

    found, missing = baselines(vuln, cost, rate, target, measure, seed=seed)
    notes += missing
    return [_mixture(vuln, name, choice, reps, seed) for name, choice in found]


def _claims(vuln, cost, rate, mixtures: list[Mixture]) -> list[Estimate]:
    """Each mixture's overhead as the cost model predicts it, with the guard's."""
    from attnchecker.adaptive.controller import priced

    guard = cost.recovery.get("guard", Estimate(0.0, 0.0, 0.0))
    out = []
    for m in mixtures:
        c = priced(vuln, cost, rate, m.checks, goal=m.name).overhead
        out.append(Estimate(*(a + b for a, b in zip(c, guard, strict=True))))
    return out


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
