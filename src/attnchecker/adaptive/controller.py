"""The controller: which ops of which layers to check, and how often, for a fault rate.

The model
---------
A *site* i is one GEMM (op x layer) of a training step (the softmax counts as one). Faults
arrive independently at rate r; site i sees lambda_i of them per step (its exposure):

- r per element operation: lambda_i = r * m_i, m_i the site's multiply-adds per step;
- r per step or per device-hour: the step's faults fall on its GEMMs in proportion to their
  work, lambda_i = r_step * m_i / M, with M every GEMM of the step (attention, MLP, head;
  forward and backward) and r_step = r * t_step / 3600 for a rate per device-hour.

A fault of kind k (probability pi_k) at site i makes training non-trainable with probability
v_ik(S) while the checks S run, from the campaign's trials at that (op, layer, kind) (a layer
the campaign did not measure takes its op's trials pooled over the measured layers; an op the
campaign never faulted is left out, like the MLP: nothing is known of it). With check arms
(``campaign --check-arms``) v_ik(S) is the share of trials that no check of S kept trainable
alone (:meth:`Cell.rate_with`, checks named relative to the fault's layer): a check covers
what it saves at other sites, in its layer and others (the context check's repair recomputes
scores and probabilities; a check downstream of an unchecked fault, a later layer's or any
backward check, detects it and the guard skips the update). Without them a check is credited
with its own site only (v_ik(S) = the protected arm's rate when i's own check is in S, else
the unprotected arm's). Checks run every step or every k steps (one k per schedule, all on
the same steps), so per step

    L = sum_i lambda_i * sum_k pi_k * ((1 - 1/k) v_ik(A) + 1/k v_ik(A + P))

expected non-trainable events (A the every-step checks, P the periodic ones; for rare faults
the probability of two in one step is second order), reported per million steps. The
overhead is additive over checks,

    C = E + sum_i f_i * c_i      (C = 0 when nothing is checked; f_i = 1, 1/k or 0)

with E what leaving SDPA for the checked engine costs (charged only when a core check is
chosen: with none, the model's own attention runs and only the projections and linear layers
are checked) and c_i the op's measured cost per layer,
both fractions of the plain step (:mod:`attnchecker.adaptive.bench`). Minimising L under C <=
budget (or C under L <= target) is a knapsack with interactions: the greedy takes the check that
removes the most risk per cost given the checks already taken (a check adds little where another
already covers its sites), every step while checks fit and then every k steps, for each k of
:data:`PERIODS`, keeping the best (:class:`~attnchecker.adaptive.knapsack.Greedy`). A budget is
a contract: a schedule fits when the upper end of its cost interval (E and every c_i at their
high ends) does, so the measured overhead stays within the budget unless the cost profile itself
was wrong (``attnchecker validate`` checks that). Costs do not add per op, though (many checks
together measured up to 1.5 times their sum): :func:`fit_measured` (``plan --verify``) measures
the choice as it trains and backs off until its measured overhead fits.

Intervals: each rate's Wilson interval enters L at its ends, so L's interval is the sum of
the ends (wider than its stated confidence); decisions use the upper end (``estimate="high"``),
so a target is met with that confidence; C's interval sums the order-statistic intervals.

Where it is conservative
------------------------
- Without check arms a check is credited only with faults at its own site (above). With
  them, pooled layers judge an arm on the layers whose trials ran it (a check three layers
  later exists for a fault in the first of four layers only; :meth:`Cell.categories`), which
  assumes layers alike. Checks are combined by the union rule (a trial
  survives a set of checks when one of them saved it alone): an assumption, not measured (the
  campaign runs each check alone, not every set), and not conservative in general; it holds
  when a check's effect on a fault does not depend on the other checks (a correction leaves
  later checks clean inputs; a detection skips the update whichever check made it).
- Summed interval ends (above).
- Costs add per op. An op's measured cost includes work it shares with others (the layer's
  records, shared norms), which over-counts many checks together; on a small model the
  Python work per protected module can go the other way (measured: ``simulate``).
Not in L: faults outside the profiled GEMMs (ops the campaign did not fault, MLP, LM head,
optimizer); the profiled sites' share of the step's work is reported as ``coverage``. Nor the
updates a detection skips (``skip_step``): a step lost, not training; a schedule that detects
far from a fault skips where its own check would have corrected (``validate`` counts them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnchecker.adaptive.knapsack import PERIODS, Greedy, active_checks, site_risk
from attnchecker.adaptive.profile import (
    ENGINE,
    Cell,
    CostProfile,
    Estimate,
    VulnerabilityProfile,
    relative,
)
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import CORE_OPS, INVARIANT_OPS, linear_parts, op_key
from attnchecker.attention.schedule import Schedule
from attnchecker.errors import ConfigError

__all__ = [
    "ESTIMATES",
    "PERIODS",
    "RATE_UNITS",
    "Choice",
    "FaultRate",
    "Site",
    "choose",
    "fit_measured",
    "load_plan",
    "parse_kinds",
    "priced",
    "risk_of",
    "save_plan",
    "sites",
]

RATE_UNITS = ("step", "element-op", "device-hour", "device-day")
ESTIMATES = ("high", "point")  # which end of the risk intervals decides: the upper, or the point
PER_MILLION = 1e6


@dataclass(frozen=True)
class FaultRate:
    """Faults per ``per`` (:data:`RATE_UNITS`), with their distribution over ``kinds``
    (None: uniform over the kinds the vulnerability profile measured)."""

    value: float
    per: str = "step"
    kinds: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if not self.value >= 0:
            raise ConfigError(f"the fault rate must be >= 0, got {self.value!r}")
        if self.per not in RATE_UNITS:
            raise ConfigError(f"a fault rate is per {' / '.join(RATE_UNITS)}, got {self.per!r}")
        if self.kinds is not None:
            if not self.kinds or any(not p >= 0 for p in self.kinds.values()):
                raise ConfigError(f"kind probabilities must be >= 0, got {self.kinds!r}")
            total = sum(self.kinds.values())
            if total <= 0:
                raise ConfigError("kind probabilities must not all be 0")
            object.__setattr__(self, "kinds", {k: p / total for k, p in self.kinds.items()})

    def per_step(self, macs: int, cost: CostProfile) -> float:
        """Faults per step at a site of ``macs`` multiply-adds."""
        if self.per == "element-op":
            return self.value * macs
        hours = {"device-hour": 1.0, "device-day": 24.0}.get(self.per)
        steps = self.value if hours is None else self.value * cost.step_seconds / (3600 * hours)
        return steps * macs / cost.step_macs


def parse_kinds(text: str | None) -> dict[str, float] | None:
    """A kind distribution as written at the command line, ``nan=0.5,inf=0.5`` (the
    ``kinds`` of :class:`FaultRate`); None or "" stays None (uniform)."""
    if not text:
        return None
    try:
        return {k: float(p) for k, p in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise ConfigError(f"--kinds is kind=probability,..., got {text!r}") from None


@dataclass(frozen=True)
class Site:
    """One (layer, op) as the controller sees it: faults per step, the campaign's trials of a
    fault here per kind (with the kind's probability), cost per step as a fraction of the plain
    step."""

    layer: int
    op: str
    faults: float
    cells: tuple[tuple[float, Cell], ...]  # (probability of the kind, its trials)
    cost: Estimate
    launches: float
    note: str = ""  # "extrapolated": the op's trials pooled over other layers
    confidence: float = 0.95
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def relevant(self) -> frozenset[str]:
        """The checks credited here, relative to this layer: its own, and every check arm of
        its cells."""
        own = relative(self.op, 0)
        return frozenset({own}.union(*(cell.checks for _, cell in self.cells)))

    def covers(self, layer: int, op: str) -> bool:
        """Whether a check of ``op`` in ``layer`` is credited with faults here."""
        return relative(op, layer - self.layer) in self.relevant

    def names(self, on: frozenset[tuple[int, str]]) -> frozenset[str]:
        """The checks ``on`` ((layer, op)) credited here, named relative to this layer."""
        names = (relative(op, at - self.layer) for at, op in on)
        return frozenset(n for n in names if n in self.relevant)

    def rate(self, on: frozenset[tuple[int, str]]) -> Estimate:
        """The probability that a fault here makes training non-trainable while the checks
        ``on`` ((layer, op)) run, mixed over kinds (:meth:`Cell.rate_with`)."""
        if on in self._memo:
            return self._memo[on]
        key = self.names(on)
        if key not in self._memo:  # another set of checks credited alike here
            ends = [0.0, 0.0, 0.0]
            for p, cell in self.cells:
                for j, e in enumerate(cell.rate_with(key, self.confidence)):
                    ends[j] += p * e
            self._memo[key] = Estimate(*ends)
        self._memo[on] = self._memo[key]
        return self._memo[on]


def sites(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate,
          confidence: float = 0.95) -> list[Site]:  # fmt: skip
    """Every checkable (layer, op) of the cost profile, with its exposure and vulnerability."""
    if vuln.family != cost.family:
        raise ConfigError(
            f"the vulnerability profile is of {vuln.family}, the cost profile of {cost.family}"
        )
    kinds = rate.kinds or {k: 1 / len(vuln.kinds) for k in vuln.kinds}
    if unknown := sorted(set(kinds) - set(vuln.kinds)):
        raise ConfigError(f"kinds {unknown} were not measured; the campaign has {list(vuln.kinds)}")
    out = []
    for layer, op, macs in cost.macs:
        oc = cost.op(op)
        if oc is None:
            continue  # not checkable here (e.g. a fused projection's dx.k)
        cells = {kind: vuln.cell(op, layer, kind) for kind in kinds}
        if any(cell is None for cell, _ in cells.values()):
            continue  # the campaign did not fault this op (with every kind): not profiled
        note = "extrapolated" if any(pooled for _, pooled in cells.values()) else ""
        n = len(cost.layers(op))
        out.append(
            Site(layer, op, rate.per_step(macs, cost),
                 tuple((p, cells[kind][0]) for kind, p in kinds.items()),
                 oc.cost.scaled(1 / n), oc.launches / n, note, confidence)
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class Choice:
    """What the controller chose, and what it expects of it."""

    config: ABFTConfig
    checks: tuple[tuple[int, str, int], ...]  # (layer, op, every)
    risk: Estimate  # non-trainable events per million steps with the choice
    unprotected: Estimate  # ... with no check
    full: Estimate  # ... with every check every step
    overhead: Estimate  # fraction of the plain step
    full_overhead: Estimate
    launches: float  # ops launched per step beyond the plain model's
    coverage: float  # share of the step's multiply-adds at the profiled sites
    goal: str
    notes: tuple[str, ...] = ()
    measured: Estimate | None = None  # the overhead measured on this machine (fit_measured)

    @property
    def schedule(self) -> Schedule:
        """The schedule the choice runs (the config's; ``protect_`` builds the same value)."""
        return Schedule.of(self.config)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        return d

    def lines(self, step_seconds: float | None = None) -> list[str]:
        """What ``attnchecker plan`` prints."""
        by_op: dict[tuple[str, int], list[int]] = {}
        for layer, op, every in self.checks:
            by_op.setdefault((op, every), []).append(layer)
        out = [f"goal: {self.goal}"]
        if not self.checks:
            out.append("choice: no check (protect_ is not needed)")
        for (op, every), layers in sorted(by_op.items(), key=lambda x: op_key(x[0][0])):
            when = "every step" if every == 1 else f"every {every} steps"
            out.append(f"  check {op:<7} layers {_ranges(layers)}: {when}")
        out += [
            "non-trainable events per million steps (point [interval]):",
            f"  unprotected        {_est(self.unprotected)}",
            f"  with this choice   {_est(self.risk)}",
            f"  everything checked {_est(self.full)}",
            f"expected overhead vs the plain model (SDPA): {_pct(self.overhead)} "
            f"(everything checked: {_pct(self.full_overhead)}), "
            f"{self.launches:.0f} more ops launched per step",
            *[f"measured overhead on this machine: {_pct(m)}" for m in [self.measured] if m],
            f"faults covered: {self.coverage:.1%} of the step's multiply-adds are at profiled "
            f"sites (the rest: MLP, LM head, ... are not in these numbers)",
        ]
        if step_seconds:
            days = PER_MILLION * step_seconds * (1 + self.overhead.point) / 86400
            out.append(f"a million steps here is {days:.1f} device-days")
        return out + [f"note: {n}" for n in self.notes]


def _ranges(layers: list[int]) -> str:
    layers, parts, i = sorted(layers), [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(parts)


def _est(e: Estimate) -> str:
    return f"{e.point:.4g} [{e.low:.4g}, {e.high:.4g}]"


def _pct(e: Estimate) -> str:
    return f"{e.point:+.1%} [{e.low:+.1%}, {e.high:+.1%}]"


def _risk(ss: list[Site], f: dict[int, float]) -> Estimate:
    active = active_checks(ss, f)
    return Estimate(*(PER_MILLION * sum(site_risk(s, active, j) for s in ss) for j in range(3)))


def risk_of(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate,
            checks: tuple[tuple[int, str, int], ...]) -> Estimate:  # fmt: skip
    """Expected non-trainable events per million steps at ``rate`` with the ``checks``
    ((layer, op, every), a schedule)."""
    every = {(layer, op): 1 / k for layer, op, k in checks}
    ss = sites(vuln, cost, rate)
    return _risk(ss, {i: every.get((s.layer, s.op), 0.0) for i, s in enumerate(ss)})


def _least(ss: list[Site], ids: list[int]) -> float:
    """The cheapest of the checks ``ids`` (upper end), every ``PERIODS[-1]`` steps."""
    return min((max(ss[i].cost.high, 0.0) for i in ids), default=math.inf) / PERIODS[-1]


def _core(ss: list[Site], f: dict[int, float]) -> bool:
    """Whether ``f`` checks a core op: only then does the checked engine replace the model's
    own attention (:meth:`~attnchecker.attention.state.AttentionState.needs_core`)."""
    return any(v and ss[i].op in CORE_OPS for i, v in f.items())


def _overhead(ss: list[Site], f: dict[int, float], engine: Estimate) -> Estimate:
    if not any(f.values()):
        return Estimate(0.0, 0.0, 0.0)
    e = engine if _core(ss, f) else Estimate(0.0, 0.0, 0.0)
    return Estimate(*(e[j] + sum(v * ss[i].cost[j] for i, v in f.items()) for j in range(3)))


def choose(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    *,
    target: float | None = None,
    budget: float | None = None,
    confidence: float = 0.95,
    estimate: str = "high",
    policy: str = "skip_step",
) -> Choice:
    """The cheapest schedule whose expected non-trainable events per million steps are at most
    ``target``, or the one with the fewest within ``budget`` (overhead, a fraction of the plain
    step): see the module docstring. ``estimate``: which end of the risk intervals decides
    ("high": the target holds with ``confidence``; "point")."""
    if (target is None) == (budget is None):
        raise ConfigError("give a target (events per million steps) or a budget, not both")
    if target is not None and not target >= 0:
        raise ConfigError(f"the target must be >= 0 events per million steps, got {target!r}")
    if budget is not None and not budget >= 0:
        raise ConfigError(f"the budget must be an overhead >= 0 (0.05 = 5%), got {budget!r}")
    if estimate not in ESTIMATES:
        raise ConfigError(f"estimate must be 'high' or 'point', got {estimate!r}")
    end = {"point": 0, "high": 2}[estimate]
    ss = sites(vuln, cost, rate, confidence)
    if not ss:
        raise ConfigError(
            f"the profiles share no site: the campaign faulted {list(vuln.ops)}, the cost "
            f"profile measured {[o.op for o in cost.ops]}"
        )
    base = _base(ss, cost)
    greedy = Greedy(ss, end)
    useful = [i for i in range(len(ss)) if greedy.gain(i, 1.0, {}) > 0]
    notes = _notes(ss, rate, cost)
    if beyond := [op for op in vuln.ops if op in INVARIANT_OPS]:
        # the checks beyond the GEMMs are whole-model switches, not (layer, op) placements
        notes += (f"{', '.join(beyond)}: faulted by the campaign but checked by "
                  "ABFTConfig(invariants=('norm', 'update')), a switch for the whole model that "
                  "this schedule does not place or price: the campaign's report has their "
                  "outcomes, docs/invariants.md their cost",)  # fmt: skip
    # without a core check the engine is not paid: the best schedule of those checks alone
    # competes with the best of all of them, which pays it
    own = Greedy(ss, end, frozenset(i for i, s in enumerate(ss) if s.op not in CORE_OPS))
    if target is not None:
        goal = f"at most {target:g} non-trainable events per million steps ({estimate} estimate)"
        fits = [f for f in (own.for_target(target / PER_MILLION),
                            greedy.for_target(target / PER_MILLION)) if f is not None]  # fmt: skip
        f = min(fits, key=lambda f: _overhead(ss, f, cost.engine).point, default=None)
        if f is None:
            raise ConfigError(
                f"no schedule meets {target:g} non-trainable events per million steps: checking "
                f"every op of every layer every step still leaves {base['full'][end]:.4g} "
                f"({estimate} estimate at {confidence:.0%}: the protected arm's residual rate, "
                f"bounded by the campaign's trials per cell; more trials tighten it)"
            )
    else:
        goal = f"overhead at most {budget:.1%} of the plain step"
        if not useful:
            f = {}
        else:
            core = [i for i in useful if ss[i].op in CORE_OPS]
            free = [i for i in useful if ss[i].op not in CORE_OPS]
            cheapest = min(cost.engine.high + _least(ss, core), _least(ss, free))
            if budget < cheapest:
                raise ConfigError(
                    f"a budget of {budget:.1%} is below the cheapest check: {cheapest:.2%} (a "
                    f"core check also pays for leaving SDPA for the checked engine, up to "
                    f"{cost.engine.high:.1%}; every {PERIODS[-1]} steps; upper ends of the "
                    f"measured costs); raise the budget or leave the model unprotected"
                )
            options = [own.for_budget(budget)]
            if budget - cost.engine.high >= 0:
                options.append(greedy.for_budget(budget - cost.engine.high))
            f = min(options, key=lambda f: (greedy.total(f), _overhead(ss, f, cost.engine).high))
    if not useful:
        notes += ("no check removes risk at this fault rate: nothing to check",)
    checks = tuple(sorted(((ss[i].layer, ss[i].op, round(1 / v)) for i, v in f.items() if v),
                          key=lambda c: (c[0], op_key(c[1]))))  # fmt: skip
    return _choice(ss, f, checks, cost, base, goal, notes, policy)


def _base(ss: list[Site], cost: CostProfile) -> dict[str, Any]:
    """What every choice among ``ss`` states alike: the risk with no check and with every
    check, every check's overhead, the profiled sites' share of the step's work."""
    everything = {i: 1.0 for i in range(len(ss))}
    return dict(unprotected=_risk(ss, {}), full=_risk(ss, everything),
                full_overhead=_overhead(ss, everything, cost.engine),
                coverage=sum(cost.macs_of(s.layer, s.op) for s in ss) / cost.step_macs)  # fmt: skip


def _choice(ss, f, checks, cost, base, goal, notes, policy) -> Choice:
    scope = "all_linear" if any(linear_parts(op) for _, op, _ in checks) else "attention"
    config = (ABFTConfig(schedule=checks, policy=policy, backend=ENGINE, scope=scope) if checks
              else ABFTConfig(ops=()))  # fmt: skip
    engine = cost.engine_launches if _core(ss, f) else 0
    launches = (engine + sum(v * ss[i].launches for i, v in f.items())) if f else 0
    return Choice(config, checks, _risk(ss, f), overhead=_overhead(ss, f, cost.engine),
                  launches=launches, goal=goal, notes=notes, **base)  # fmt: skip


def priced(
    vuln: VulnerabilityProfile,
    cost: CostProfile,
    rate: FaultRate,
    checks: tuple[tuple[int, str, int], ...],
    *,
    goal: str,
    policy: str = "skip_step",
) -> Choice:
    """The :class:`Choice` of a schedule chosen otherwise (a naive baseline): its ``checks``
    ((layer, op, every)) with the risk and overhead the controller would predict for them."""
    ss = sites(vuln, cost, rate)
    at = {(s.layer, s.op): i for i, s in enumerate(ss)}
    if unknown := [(layer, op) for layer, op, _ in checks if (layer, op) not in at]:
        raise ConfigError(f"checks at sites the profiles do not share: {unknown}")
    f = {at[layer, op]: 1 / every for layer, op, every in checks}
    base = _base(ss, cost)
    return _choice(ss, f, tuple(checks), cost, base, goal, (), policy)


def _notes(ss: list[Site], rate: FaultRate, cost: CostProfile) -> tuple[str, ...]:
    notes = []
    pooled = sorted({s.op for s in ss if "extrapolated" in s.note}, key=op_key)
    if pooled:
        notes.append(f"{', '.join(pooled)}: some layers from the op's trials in other layers")
    profiled = {s.op for s in ss}
    if left := [o.op for o in cost.ops if o.op not in profiled]:
        notes.append(f"not faulted by the campaign, so not in these numbers: {', '.join(left)}")
    if any(cell.checks for s in ss for _, cell in s.cells):
        notes.append("a check is credited with what it saved alone at other sites, in its "
                     "layer and others (the campaign's check arms)")  # fmt: skip
    else:
        notes.append("a check is credited with its own site only (the campaign ran no check "
                     "arms: campaign --check-arms measures what each check covers)")  # fmt: skip
    if rate.value == 0:
        notes.append("fault rate 0: no check pays for itself")
    return tuple(notes)


def fit_measured(vuln: VulnerabilityProfile, cost: CostProfile, rate: FaultRate, budget: float,
                 measure: Callable[[Choice], Estimate], *, tries: int = 6,
                 **kw: Any) -> Choice:  # fmt: skip
    """:func:`choose` within ``budget``, then ``measure`` the choice as it trains; while the
    measured overhead's upper end is over the budget (costs do not add per op: a schedule of
    many checks can measure half again its predicted cost), choose again within what the cost
    model priced the choice at (its upper end; the budget asked, when that is lower) scaled by
    budget / measured, at most ``tries`` times: the model's error on this choice corrected,
    so a model many times too cheap (whose choice sits far below the budget it was given)
    converges in a few tries. The choice carries its measurement; raises
    :class:`ConfigError` when no schedule measures within the budget."""
    b, tried = budget, []
    for _ in range(tries):
        try:
            choice = choose(vuln, cost, rate, budget=b, **kw)
        except ConfigError as e:  # scaled below the cheapest check
            raise ConfigError(f"no schedule measured within {budget:.0%} ({'; '.join(tried)}, "
                              f"upper ends); then {e}") from None  # fmt: skip
        if not choice.checks:
            return choice
        m = measure(choice)
        tried.append(f"{len(choice.checks)} checks {m.high:+.1%}")
        note = (f"measured {_pct(m)} on this machine (tried: {'; '.join(tried)}; the cost "
                f"model's budget {b:.1%})")  # fmt: skip
        choice = dataclasses.replace(choice, measured=m, notes=(*choice.notes, note))
        if m.high <= budget:
            return choice
        b = min(b, choice.overhead.high) * budget / m.high
    raise ConfigError(
        f"no schedule measured within {budget:.0%} in {tries} tries ({'; '.join(tried)}, upper "
        f"ends): give a larger budget"
    )


def save_plan(choice: Choice, rate: FaultRate, path: str | Path) -> Path:
    """``attnchecker plan``'s file: the fault rate and the choice, whose ``config`` is the
    :class:`ABFTConfig` to protect with (:func:`load_plan`)."""
    path = Path(path)
    path.write_text(json.dumps({"rate": vars(rate), **choice.to_dict()}, indent=1))
    return path


def load_plan(path: str | Path, backend: str | None = None) -> ABFTConfig:
    """The :class:`ABFTConfig` of a plan file (:func:`save_plan`; ``train --plan``), on the
    engine it was priced for (:data:`ENGINE`; plans written before engines were pinned say
    "auto" and were priced on it too); ``backend``, the one asked for, must be that engine."""
    config = ABFTConfig.from_dict(json.loads(Path(path).read_text())["config"])
    if backend is not None and backend != ENGINE and config.schedule:
        raise ConfigError(
            f"{path} was priced for the {ENGINE} engine (its checks are that engine's ops and "
            f"costs); backend={backend!r} would run other checks at other costs: train it with "
            f"--backend {ENGINE}, or protect without a plan"
        )
    return config.replace(backend=ENGINE) if config.schedule else config
