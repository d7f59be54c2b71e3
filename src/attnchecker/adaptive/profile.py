"""The two profiles the controller decides from, as versioned JSON files.

- :class:`VulnerabilityProfile`: for one family, per (op, layer, fault kind), how many campaign
  trials (:mod:`attnchecker.inject.campaign`) ended in each outcome, unprotected and protected;
  rates come with Wilson score intervals from those counts. A campaign run with check arms
  (``--check-arms``) adds, per cell, which checks alone kept each trial trainable: the
  non-trainable rate under any set of checks (:meth:`Cell.rate_with`). Written next to the
  campaign as ``vulnerability-<family>.json``.
- :class:`CostProfile`: what checking each op costs on this machine (a fraction of the plain
  model's training step with transformers' default SDPA attention, all layers checked), what
  leaving SDPA for the checked engine costs, the ops launched, and each GEMM's size in element
  operations (multiply-adds) per step: the exposure of a site to faults. Measured by
  :func:`attnchecker.adaptive.bench.measure_costs` (``attnchecker bench``),
  ``cost-<family>.json``.

Where they live next to a campaign (``vulnerability-<family>.json``, ``cost-<family>.json``) and
what a campaign directory says (its families, its model and batch shape) is read here too, so
the CLI only names a directory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from attnchecker.attention.ops import op_key
from attnchecker.errors import ConfigError
from attnchecker.inject.plan import check_op

__all__ = [
    "CONFIDENCES",
    "ENGINE",
    "Cell",
    "CostProfile",
    "Estimate",
    "OpCost",
    "VulnerabilityProfile",
    "campaign_family",
    "campaign_setup",
    "cost_path",
    "load_profiles",
    "relative",
    "vulnerability_path",
    "wilson",
    "write_vulnerability_profiles",
]

PROFILE_VERSION = 1
ENGINE = "eager"
"""The engine a cost profile prices and a plan's config pins (``ABFTConfig.backend``): the
checked eager attention, whose ops a schedule names; the fused kernels' checks are not priced
yet, so a plan is refused on them (``controller.load_plan``)."""
OUTCOMES = ("masked", "silent_deviation", "loss_spike", "non_trainable")
_Z = {0.8: 1.2816, 0.9: 1.6449, 0.95: 1.9600, 0.99: 2.5758}
CONFIDENCES = tuple(_Z)  # the confidences an interval can be asked at


class Estimate(NamedTuple):
    """A point estimate and its interval."""

    point: float
    low: float
    high: float

    def scaled(self, c: float) -> Estimate:
        return Estimate(self.point * c, self.low * c, self.high * c)


def wilson(k: int, n: int, confidence: float = 0.95) -> Estimate:
    """k successes in n trials: k / n and the Wilson score interval (sensible at k = 0 and k = n,
    where the normal interval collapses to a point)."""
    if n <= 0:
        return Estimate(math.nan, 0.0, 1.0)
    if confidence not in _Z:
        raise ConfigError(f"confidence must be one of {sorted(_Z)}, got {confidence!r}")
    z, p = _Z[confidence], k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return Estimate(p, max(0.0, centre - half), min(1.0, centre + half))


def relative(op: str, offset: int) -> str:
    """A check named relative to a fault's layer: ``dw.q@+0`` in its layer, ``dw.q@-1`` in the
    layer before (the names of :attr:`Cell.checks` and of :meth:`Cell.rate_with`'s set)."""
    return f"{op}@{offset:+d}"


@dataclass(frozen=True)
class Cell:
    """The trials of one (op, layer, kind): outcome counts per arm, and with check arms
    (``checks``: the checks run alone, named by op and layer relative to the fault's,
    :func:`relative`) how many trials were non-trainable in exactly which arms (``joint``: key
    the sorted arms joined by "|", "none" for the unprotected one)."""

    op: str
    layer: int
    kind: str
    trials: int
    unprotected: dict[str, int]
    protected: dict[str, int]
    checks: tuple[str, ...] = ()
    joint: dict[str, int] = field(default_factory=dict)

    def rate(self, outcome: str = "non_trainable", *, protected: bool = False,
             confidence: float = 0.95) -> Estimate:  # fmt: skip
        counts = self.protected if protected else self.unprotected
        return wilson(counts.get(outcome, 0), self.trials, confidence)

    def rate_with(self, checked: frozenset[str], confidence: float = 0.95) -> Estimate:
        """The non-trainable rate of a fault here while the checks ``checked`` run (named
        relative to the fault's layer, :func:`relative`).

        With check arms: a trial survives a set of checks when one of them alone kept it
        trainable (a check that helps alone helps beside others), so it is non-trainable when
        it was in every arm of ``checked`` the campaign ran (none of them: the unprotected
        arm's outcome); checks without an arm are not credited. A pooled cell's rate comes from
        the trials eligible to say (:meth:`categories`). Without check arms:
        the protected arm's rate when the op's own check runs in its layer, else the
        unprotected arm's (a check credited with its own site only)."""
        if not self.checks:
            own = relative(self.op, 0) in checked
            return self.rate(protected=own, confidence=confidence)
        cats = self.categories(checked)
        n = sum(t for _, eligible, t in cats if eligible)
        k = sum(t for lost, eligible, t in cats if lost and eligible)
        rate = wilson(k, n, confidence)
        # every trial judged on the arms its layer ran (a missing arm not credited): more
        # trials, biased up, so its upper end bounds the rate too (and keeps a check from
        # raising the upper end by narrowing the eligible trials)
        bound = wilson(sum(t for lost, _, t in cats if lost), self.trials, confidence).high
        return Estimate(min(rate.point, bound), min(rate.low, bound), min(rate.high, bound))

    def categories(self, checked: frozenset[str]) -> list[tuple[bool, bool, int]]:
        """Per key of ``joint``: (its trials are lost while ``checked`` run, they are eligible
        to say so, trials). A trial pooled from a layer that did not run an arm of ``checked``
        (a check two layers after a fault in the last layer) says so only when an arm its
        layer ran saved it (then it survives whatever the missing arm does); lost in every arm
        it ran, it is not eligible. When no trial is eligible, every trial is judged on the
        arms its layer ran (a missing arm not credited)."""
        arms = checked.intersection(self.checks)
        out = []
        for lost, missing, n in self._parsed:
            dies = ((arms - missing) or {"none"}) <= lost
            out.append((dies, not dies or not (arms & missing), n))
        if not any(eligible for _, eligible, _ in out):
            out = [(dies, True, n) for dies, _, n in out]
        return out

    @functools.cached_property
    def _parsed(self) -> tuple[tuple[frozenset[str], frozenset[str], int], ...]:
        """The joint histogram as (the arms its trials were lost in, the arms their layer did
        not run, trials): keys ``lost|arms`` or, pooled, ``lost|arms;missing|arms``."""
        out = []
        for key, n in self.joint.items():
            lost, _, missing = key.partition(";")
            out.append((frozenset(lost.split("|")) - {""},
                        frozenset(missing.split("|")) - {""}, n))  # fmt: skip
        return tuple(out)


@dataclass(frozen=True)
class VulnerabilityProfile:
    family: str
    setup: dict[str, Any]  # the campaign's model and training setup (size, batch, seq_len, ...)
    cells: tuple[Cell, ...]
    version: int = PROFILE_VERSION

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.kind for c in self.cells))

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(sorted({c.op for c in self.cells}, key=op_key))

    def cell(self, op: str, layer: int, kind: str) -> tuple[Cell | None, bool]:
        """The trials of (op, layer, kind), or when that layer was not measured the op's trials
        pooled over the layers that were (second value True: extrapolated); (None, False) when
        the op or kind was never measured."""
        mine = [c for c in self.cells if c.op == op and c.kind == kind]
        exact = [c for c in mine if c.layer == layer]
        if exact:
            return exact[0], False
        if not mine:
            return None, False
        if len(mine) == 1 and mine[0].layer == -1:  # a pooled profile: every layer alike
            return mine[0], False
        return _merged(mine, op, -1, kind), True  # layer -1: pooled, as in pooled()

    def pooled(self) -> VulnerabilityProfile:
        """The same trials with layers merged per (op, kind), layer -1 standing for every layer:
        for campaigns with few trials per layer, when layers are taken to be alike."""
        groups: dict[tuple[str, str], list[Cell]] = defaultdict(list)
        for c in self.cells:
            groups[(c.op, c.kind)].append(c)
        cells = tuple(_merged(cs, op, -1, kind) for (op, kind), cs in groups.items())
        return dataclasses.replace(self, cells=cells)

    @classmethod
    def from_campaign(cls, out: str | Path, family: str | None = None) -> VulnerabilityProfile:
        """The profile of ``family`` (the campaign's only one when None) from its trial files."""
        from attnchecker.inject.campaign import load_trials

        out = Path(out)
        config = _campaign_config(out)
        rows = load_trials(out)
        family = _one_family(out, rows, family)
        groups: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
        for r in rows:  # a linear layer's site (linear:mlp.c_fc:y) is its check's op
            if r["family"] == family:
                key = (check_op(r["site"]), r.get("layer", config["layer"]), r["kind"])
                groups[key].append(r)
        cells = tuple(
            Cell(op, layer, kind, len(rs), _count(rs, "unprotected"), _count(rs, "protected"),
                 *_joint(rs, config))
            for (op, layer, kind), rs in sorted(groups.items())
        )  # fmt: skip
        keys = ("size", "batch", "seq_len", "steps", "lr", "seed", "patterns", "backend", "dropout")
        return cls(family, {k: config[k] for k in keys if k in config}, cells)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VulnerabilityProfile:
        _version(d, "vulnerability profile")
        cells = tuple(Cell(**c | {"checks": tuple(c.get("checks", ()))}) for c in d["cells"])
        return cls(d["family"], d["setup"], cells, d["version"])

    def save(self, path: str | Path) -> Path:
        return _save(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> VulnerabilityProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class OpCost:
    """Checking ``op`` in every layer: its time beyond the engine's, as a fraction of the plain
    step (median over paired repetitions, with an order-statistic interval), and the ops it
    launches per step."""

    op: str
    cost: Estimate
    launches: int


RECOVERY_ARMS = {
    "guard": "the finite-gradient guard with replay (no ABFT)",
    "abft": "the default protection with replay",
}
"""What ``bench`` times besides the checks: whole configurations as users run them, each
against the plain model (:attr:`CostProfile.recovery`)."""


@dataclass(frozen=True)
class CostProfile:
    family: str
    setup: dict[str, Any]  # size, batch, seq_len, layers, compile, dtype, device, reps
    step_seconds: float  # the plain model's median training step (SDPA attention)
    engine: Estimate  # protect_ with no check (the checked engine instead of SDPA), a fraction
    engine_launches: int
    ops: tuple[OpCost, ...]
    # (layer, op) -> multiply-adds of that GEMM per step (probs: elements of the softmax)
    macs: tuple[tuple[int, str, int], ...]
    step_macs: int  # every GEMM of the step (attention, MLP, head), forward and backward
    version: int = PROFILE_VERSION
    host: dict[str, Any] = field(default_factory=dict)
    # the recovery arms: "guard" (the plain model under the finite-gradient guard with replay)
    # and "abft" (the default protection with replay), fractions of the plain step as ``ops``;
    # absent in profiles measured before them
    recovery: dict[str, Estimate] = field(default_factory=dict)

    def layers(self, op: str | None = None) -> tuple[int, ...]:
        """The layers with a GEMM of ``op`` (None: of any op); a linear layer outside the
        blocks is layer -1."""
        return tuple(sorted({layer for layer, o, _ in self.macs if op in (None, o)}))

    def op(self, name: str) -> OpCost | None:
        return next((o for o in self.ops if o.op == name), None)

    def macs_of(self, layer: int, op: str) -> int:
        return next((m for at, o, m in self.macs if at == layer and o == op), 0)

    def lines(self) -> list[str]:
        """What ``attnchecker bench`` prints: the plain step, the engine's cost, each op's."""
        engine, layers = self.engine.point, self.setup["layers"]
        head = (f"plain step {1e3 * self.step_seconds:.1f} ms; leaving SDPA for the checked "
                f"engine {engine:+.1%}; per op, all {layers} layers:")  # fmt: skip
        return (
            [head]
            + [
                f"  {o.op:<7} {o.cost.point:+7.1%} [{o.cost.low:+.1%}, {o.cost.high:+.1%}] "
                f"{o.launches:5d} ops launched"
                for o in self.ops
            ]
            + [
                f"  {RECOVERY_ARMS[k]}: {e.point:+.1%} [{e.low:+.1%}, {e.high:+.1%}]"
                for k, e in self.recovery.items()
            ]
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostProfile:
        _version(d, "cost profile")
        ops = tuple(OpCost(o["op"], Estimate(*o["cost"]), o["launches"]) for o in d["ops"])
        return cls(d["family"], d["setup"], d["step_seconds"], Estimate(*d["engine"]),
                   d["engine_launches"], ops, tuple(tuple(m) for m in d["macs"]),
                   d["step_macs"], d["version"], d.get("host", {}),
                   {k: Estimate(*v) for k, v in d.get("recovery", {}).items()})  # fmt: skip

    def save(self, path: str | Path) -> Path:
        return _save(self.to_dict(), path)

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def vulnerability_path(campaign: str | Path, family: str) -> Path:
    """Where a campaign keeps ``family``'s vulnerability profile."""
    from attnchecker.models.source import tag

    return Path(campaign) / f"vulnerability-{tag(family)}.json"


def cost_path(campaign: str | Path, family: str) -> Path:
    """Where ``attnchecker bench --campaign`` keeps ``family``'s cost profile."""
    from attnchecker.models.source import tag

    return Path(campaign) / f"cost-{tag(family)}.json"


def write_vulnerability_profiles(campaign: str | Path) -> list[Path]:
    """Save the vulnerability profile of every family of the campaign in ``campaign`` next to
    its trials (:func:`vulnerability_path`); returns the files written."""
    from attnchecker.inject.campaign import load_trials

    families = sorted({r["family"] for r in load_trials(Path(campaign))})
    return [
        VulnerabilityProfile.from_campaign(campaign, f).save(vulnerability_path(campaign, f))
        for f in families
    ]


def campaign_family(campaign: str | Path, family: str | None = None) -> str:
    """``family`` if the campaign has trials of it; None: the campaign's only family."""
    from attnchecker.inject.campaign import load_trials

    return _one_family(Path(campaign), load_trials(Path(campaign)), family)


def campaign_setup(campaign: str | Path) -> dict[str, Any]:
    """The campaign's model size and batch shape (``size``, ``batch``, ``seq_len``): what a cost
    profile must be measured at to match its vulnerability profile."""
    config = _campaign_config(Path(campaign))
    return {k: config[k] for k in ("size", "batch", "seq_len")}


def load_profiles(
    campaign: str | Path, family: str | None = None, *, cost: str | Path | None = None,
    pooled: bool = False,
) -> tuple[VulnerabilityProfile, CostProfile]:  # fmt: skip
    """What the controller decides from: the vulnerability profile of ``family`` (None: the
    campaign's only one), rebuilt from the campaign's trials (layers merged when ``pooled``,
    :meth:`VulnerabilityProfile.pooled`), and the cost profile at ``cost`` (default: the one
    ``attnchecker bench --campaign`` wrote, :func:`cost_path`). Writes nothing."""
    vuln = VulnerabilityProfile.from_campaign(campaign, family)
    where = Path(cost or cost_path(campaign, vuln.family))
    if not where.exists():
        raise ConfigError(
            f"no cost profile at {where}: run attnchecker bench --campaign {campaign}"
        )
    return (vuln.pooled() if pooled else vuln), CostProfile.load(where)


def _campaign_config(out: Path) -> dict[str, Any]:
    """The resolved config of the campaign in ``out`` (its ``meta.json``, or a shard's)."""
    metas = sorted(out.glob("meta*.json"))
    if not metas:
        raise ConfigError(f"{out}: not a campaign directory (no meta.json)")
    return json.loads(metas[0].read_text())["config"]


def _one_family(out: Path, rows: list[dict[str, Any]], family: str | None) -> str:
    families = sorted({r["family"] for r in rows})
    if family is None:
        if len(families) != 1:
            raise ConfigError(
                f"{out} holds families {families}: say which one (--family)"
                if families
                else f"{out} has no trials yet"
            )
        family = families[0]
    if family not in families:
        raise ConfigError(f"{out} has no trials of {family!r}; it has {families}")
    return family


def _count(rows: list[dict], arm: str) -> dict[str, int]:
    out = dict.fromkeys(OUTCOMES, 0)
    for r in rows:
        out[r[arm]["outcome"]] += 1
    return out


def _add(cells: list[Cell], arm: str) -> dict[str, int]:
    return {o: sum(getattr(c, arm).get(o, 0) for c in cells) for o in OUTCOMES}


def _merged(cells: list[Cell], op: str, layer: int, kind: str) -> Cell:
    """One cell of the trials of ``cells``. Check arms that some of them did not run (a check
    two layers later exists for a fault in layer 0 of 4, not in layer 3) are recorded as
    missing for those trials (keys ``lost;missing``, :meth:`Cell.categories`)."""
    if not all(cell.checks for cell in cells):  # some without check arms: none kept
        return Cell(op, layer, kind, sum(c.trials for c in cells), _add(cells, "unprotected"),
                    _add(cells, "protected"))  # fmt: skip
    checks = sorted({c for cell in cells for c in cell.checks}, key=_arm_key)
    joint: dict[str, int] = defaultdict(int)
    for cell in cells:
        for lost, missing, n in cell._parsed:
            gone = missing | {c for c in checks if c not in cell.checks}
            key = "|".join(sorted(lost))
            joint[f"{key};{'|'.join(sorted(gone))}" if gone else key] += n
    return Cell(op, layer, kind, sum(c.trials for c in cells), _add(cells, "unprotected"),
                _add(cells, "protected"), tuple(checks), dict(joint))  # fmt: skip


def _arm_key(name: str) -> tuple:
    op, _, offset = name.rpartition("@")
    return (int(offset), op_key(op))


def _joint(rows: list[dict], config: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, int]]:
    """(the check arms of these trials, named relative to their layer; their joint histogram:
    :class:`Cell`); ((), {}) for a campaign without check arms. A trial the unprotected arm
    left trainable ran no check arm and counts as trainable under any check; an arm that ran
    before the fault was not run and has the unprotected arm's outcome
    (``campaign.arm_checks``); an arm missing from a trial counts as non-trainable (not
    credited)."""
    from attnchecker.inject.campaign import arm_checks, arm_name

    if not config.get("check_arms"):
        return (), {}
    layer, site = rows[0].get("layer", config["layer"]), rows[0]["site"]
    layers = config["layers"] or [config["layer"]]
    every = {arm_name(c, at): relative(c, at - layer)
             for c, at in arm_checks(config["sites"], site, layer, layers, every=True)}  # fmt: skip
    ran = {arm_name(c, at) for c, at in arm_checks(config["sites"], site, layer, layers)}
    joint: dict[str, int] = defaultdict(int)
    for r in rows:
        if r["unprotected"]["outcome"] != "non_trainable":
            joint[""] += 1
            continue
        arms = r.get("checks", {})
        outcome = {c: arms.get(c, {}).get("outcome", "non_trainable") if c in ran
                   else "non_trainable" for c in every}  # fmt: skip
        lost = [every[c] for c in every if outcome[c] == "non_trainable"]
        joint["|".join(sorted(["none", *lost]))] += 1
    return tuple(sorted(every.values(), key=_arm_key)), dict(joint)


def _version(d: dict[str, Any], what: str) -> None:
    if d.get("version") != PROFILE_VERSION:
        raise ConfigError(
            f"{what} version {d.get('version')!r}; this attnchecker reads version "
            f"{PROFILE_VERSION}: rebuild it"
        )


def _save(d: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, indent=1))
    tmp.replace(path)  # a crash never leaves half a profile
    return path
