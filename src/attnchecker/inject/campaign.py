"""Fault-injection campaigns: many trials, appended as they finish, resumable, parallel, sharded.

``run_campaign(CampaignConfig(...), out)`` enumerates families x sites x layers x kinds x
patterns x trials (each with its own seed), skips the trials already in ``out/trials*.jsonl``
(a killed campaign resumes with no trial lost or counted twice: a trial is written, flushed and
synced as one line when it finishes, and a torn last line is ignored), runs the rest in worker
processes,
and writes ``meta.json`` (config, seed, versions) and ``summary.json`` (rates per family x site
x kind x arm). With ``rank``/``world`` a campaign is split across machines: each shard writes
its own ``trials.rank<r>.jsonl`` and :func:`summarize` merges whatever files are there.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import platform
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnchecker.attention.config import ALL_OPS, OPS, ABFTConfig
from attnchecker.errors import ConfigError
from attnchecker.inject.kinds import DEFAULT_KINDS
from attnchecker.inject.trial import INVARIANT_SITES, USER_OUTCOMES

__all__ = [
    "CampaignConfig", "Progress", "arm_checks", "arm_name", "load_trials", "run_campaign",
    "summarize", "trial_specs",
]  # fmt: skip

SCHEMA_VERSION = 1
OUTCOMES = ("masked", "silent_deviation", "loss_spike", "non_trainable")
RECOVERY_ARMS = {  # name: (protected, what a step that went wrong gets)
    "guard_skip": (False, "skip"), "guard_replay": (False, "replay"),
    "protected_skip": (True, "skip"), "protected_replay": (True, "replay"),
}  # fmt: skip
"""The recovery arms (``recovery_arms``): the finite-gradient guard alone (no ABFT) and the
protected model, each skipping or replaying a step with an uncorrectable error or a non-finite
loss or gradient (:func:`attnchecker.inject.trial.run_arm`'s ``recover``)."""
RESULTS = ("corrected", "recomputed", "uncorrectable", "missed", "not_needed")


@dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    families: tuple[str, ...] = ("bert", "roberta", "gpt2", "gpt_neo")  # ATTNChecker's four
    sites: tuple[str, ...] = OPS
    kinds: tuple[str, ...] = DEFAULT_KINDS
    patterns: tuple[str, ...] = ("0D",)
    trials: int = 1  # per combination, each with its own seed (fault position)
    steps: int = 3  # training steps per run; the fault fires at step 1
    layer: int = 0
    layers: tuple[int, ...] | None = None  # the faulty layers (None: just ``layer``)
    size: str = "tiny"
    batch: int = 4
    seq_len: int = 32
    lr: float = 1e-3
    seed: int = 0
    tolerance: float = 1e-5  # relative loss deviation still counted as 'masked'
    param_tolerance: float | None = None  # absolute parameter drift still 'masked' (None: lr)
    spike_factor: float = 10.0
    workers: int = 1
    rank: int = 0
    world: int = 1
    backend: str = "eager"  # ABFTConfig.backend of every arm; "triton" adds the kernel:<site> sites
    # ("sdpa": the core's sites are emulated on the SDPA route, attention dropout too on a CPU)
    check_arms: bool = False  # an arm per check and layer per lost trial (:func:`arm_checks`)
    recovery_arms: bool = False  # the guard alone and protection, skipping or replaying
    dropout: bool = True  # False: every dropout probability 0 (a family's preset; the fused
    # kernels run attention dropout in training on the eager engine)

    def __post_init__(self) -> None:
        from attnchecker.attention.config import BACKENDS
        from attnchecker.inject.kinds import FaultKind
        from attnchecker.inject.plan import Fault, FaultPattern
        from attnchecker.kernels import KERNEL_SITES
        from attnchecker.models.families import FAMILIES

        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        kernel = [f"kernel:{s}" for s in KERNEL_SITES] if self.backend == "triton" else []
        from attnchecker.models.source import kind_of

        own = [f for f in self.families if f not in FAMILIES and kind_of(f)]  # the user's own
        linear = [s for s in self.sites if s.startswith("linear:")]  # checked by Fault
        for site in linear:
            Fault(step=1, site=site)
        for name, values, allowed in [
            ("families", self.families, [*FAMILIES, *own]),
            ("sites", self.sites, [*ALL_OPS, *kernel, *linear, *INVARIANT_SITES]),
            ("kinds", self.kinds, [k.value for k in FaultKind]),
            ("patterns", self.patterns, [p.value for p in FaultPattern]),
        ]:
            if bad := sorted(set(values) - set(allowed)):
                raise ConfigError(f"unknown {name} {bad}; choose from {list(allowed)}")
        if "bit_flip" in self.kinds:
            raise ConfigError("campaigns use exponent_flip for bit flips (a bit_flip needs a bit)")
        if self.layers is not None and (
            not self.layers or any(not isinstance(i, int) or i < -1 for i in self.layers)
        ):
            raise ConfigError(
                f"layers must be layer indices (-1: linear layers outside the blocks, such as "
                f"linear:lm_head:y), got {self.layers!r}"
            )
        if self.check_arms and (self.backend == "triton" or any(kernel)):
            raise ConfigError(
                "check arms run one check of a schedule alone; the fused kernels' checks are not "
                "ops of a schedule: use backend='eager' with check_arms"
            )
        if any(s.startswith("update.") for s in self.sites) and self.steps < 2:
            raise ConfigError("update.* sites fire before step 2's update: steps must be >= 2")
        if self.trials < 1 or self.steps < 1 or self.workers < 1:
            raise ConfigError("trials, steps and workers must be >= 1")
        if not 0 <= self.rank < self.world:
            raise ConfigError(
                f"rank must be in [0, world), got rank={self.rank}, world={self.world}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def faulty_layers(self) -> tuple[int, ...]:
        return (self.layer,) if self.layers is None else self.layers


def trial_specs(cfg: CampaignConfig) -> list[dict[str, Any]]:
    """Every trial of the campaign, in a fixed order with stable ids (this shard's share)."""
    specs = []
    i = 0
    for fam in cfg.families:
        for site in cfg.sites:
            for layer in cfg.faulty_layers:
                if layer < 0 and not site.startswith("linear:"):
                    continue  # layer -1 has linear layers only (the LM head)
                for kind in cfg.kinds:
                    for pattern in cfg.patterns:
                        for rep in range(cfg.trials):
                            if i % cfg.world == cfg.rank:
                                spec = {"id": i, "family": fam, "site": site, "layer": layer,
                                        "kind": kind, "pattern": pattern}  # fmt: skip
                                specs.append(spec | {"rep": rep, "seed": cfg.seed * 100_003 + i})
                            i += 1
    return specs


def arm_checks(sites: Sequence[str], site: str, layer: int, layers: Sequence[int], *,
               every: bool = False) -> tuple[tuple[str, int], ...]:  # fmt: skip
    """The check arms (``check_arms``) of a trial at ``site`` in ``layer``: (check, layer) for
    the check of every site of the campaign (``sites``) in every faulty layer (``layers``;
    attention ops only in a block, layer >= 0), except (unless ``every``) those that ran
    before the fault in its step, whose arm would be the unprotected arm: a forward check for a
    backward fault, a forward check in an earlier layer for a forward fault, a backward check
    in a later layer (the backward runs from the last layer down) for a backward fault."""
    from attnchecker.attention.ops import in_backward, linear_parts
    from attnchecker.inject.plan import check_op

    backward = in_backward(check_op(site))
    out = []
    for c in dict.fromkeys(check_op(s) for s in sites):
        for at in dict.fromkeys(layers):
            if at < 0 and not linear_parts(c):
                continue  # no attention outside the blocks
            if in_backward(c) != backward:
                before = backward  # a forward check of a backward fault
            else:
                before = at > layer if backward else at < layer
            if every or not before:
                out.append((c, at))
    return tuple(out)


def arm_name(check: str, at: int) -> str:
    """A check arm's name in a trial's row: ``dw.q@2``, the check and the layer it ran in."""
    return f"{check}@{at}"


def _trials_file(out: Path, cfg: CampaignConfig) -> Path:
    return out / ("trials.jsonl" if cfg.world == 1 else f"trials.rank{cfg.rank}.jsonl")


def load_trials(out: Path) -> list[dict[str, Any]]:
    """Every complete trial line of every shard file under ``out`` (a torn last line is skipped)."""
    rows = []
    for path in sorted(Path(out).glob("trials*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # interrupted while writing: the trial reruns on resume
    return rows


# ----------------------------------------------------------------------------- workers

_SETUPS: dict[tuple, Any] = {}
_SETUP_FIELDS = ("size", "seed", "seq_len", "batch", "steps", "lr", "backend", "dropout")
"""What defines a worker's model, batches and reference run besides the family: its cache key
(a second campaign in one process must never reuse the first one's setup)."""


def _setup(cfg: CampaignConfig, family: str, layer: int):
    key = (family, layer, *(getattr(cfg, f) for f in _SETUP_FIELDS))
    if key not in _SETUPS:
        import torch

        from attnchecker.inject.trial import reference
        from attnchecker.models.source import make

        model = make(family, size=cfg.size, seed=cfg.seed, seq_len=cfg.seq_len,
                     dropout=cfg.dropout)  # fmt: skip
        g = torch.Generator().manual_seed(cfg.seed)
        batches = []
        for _ in range(cfg.steps):
            ids = torch.randint(3, 128, (cfg.batch, cfg.seq_len), generator=g)
            batches.append(
                {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            )
        _SETUPS[key] = reference(family, model, batches, cfg.lr, layer, cfg.backend)
    return _SETUPS[key]


def _run_one(args: tuple[CampaignConfig, dict[str, Any]]) -> dict[str, Any]:
    import torch

    from attnchecker.inject.plan import Fault
    from attnchecker.inject.trial import invariant_fault, run_arm

    torch.set_num_threads(1)
    cfg, spec = args
    layer = spec.get("layer", cfg.layer)
    setup = _setup(cfg, spec["family"], layer)
    if spec["site"] in INVARIANT_SITES:  # a norm's output, an optimizer tensor (step 2)
        fault = invariant_fault(setup.model, spec["site"], layer, kind=spec["kind"],
                                pattern=spec["pattern"], size=(2, 3))  # fmt: skip
    else:
        fault = Fault(
            step=1,
            site=spec["site"],
            kind=spec["kind"],
            pattern=spec["pattern"],
            layer=layer,
            size=(2, 3),
        )
    param_tol = cfg.lr if cfg.param_tolerance is None else cfg.param_tolerance
    judge = dict(tol=cfg.tolerance, spike=cfg.spike_factor, param_tol=param_tol)
    arms: dict[str, Any] = {
        arm: run_arm(setup, fault, spec["seed"], protected=arm == "protected", **judge)
        for arm in ("unprotected", "protected")
    }
    if cfg.recovery_arms:
        kept = ("outcome", "result", "skipped", "replayed", "user", "loss_delta",
                "param_distance")  # fmt: skip
        for arm, (protected, recover) in RECOVERY_ARMS.items():
            row = run_arm(setup, fault, spec["seed"], protected=protected, recover=recover, **judge)
            arms[arm] = {k: v for k, v in row.items() if k in kept}
    dead = arms["unprotected"]["outcome"] == "non_trainable"  # else trainable with any check
    if cfg.check_arms and dead and spec["site"] not in INVARIANT_SITES:
        kept = ("outcome", "result", "detected_at_site", "skipped", "user")
        arms["checks"] = {
            arm_name(c, at): {k: v for k, v in run_arm(setup, fault, spec["seed"],
                                                       protected=True, check=(c, at),
                                                       **judge).items() if k in kept}
            for c, at in arm_checks(cfg.sites, spec["site"], layer, cfg.faulty_layers)
        }  # fmt: skip
    return spec | {"schema_version": SCHEMA_VERSION, "ref_final_loss": setup.ref_losses[-1], **arms}


def run_campaign(cfg: CampaignConfig, out: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) the campaign into ``out``; returns the summary of all trials there."""
    import torch
    import transformers

    _check_linear_sites(cfg)  # before any trial: a missing layer would stop the run midway
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "schema_version": SCHEMA_VERSION,
        "config": cfg.to_dict(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }  # fmt: skip
    (out / ("meta.json" if cfg.world == 1 else f"meta.rank{cfg.rank}.json")).write_text(
        json.dumps(meta, indent=2)
    )
    done = {t["id"] for t in load_trials(out)}
    todo = [s for s in trial_specs(cfg) if s["id"] not in done]
    path = _trials_file(out, cfg)
    _drop_torn_tail(path)
    with path.open("a") as f, Progress(len(todo), progress) as advance:
        for row in _results(cfg, todo):
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
            advance()
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _check_linear_sites(cfg: CampaignConfig) -> None:
    """Every linear site of the campaign names a linear layer outside attention that each
    family's model has at each faulty layer; raises :class:`ConfigError` listing what there is."""
    import torch

    from attnchecker.attention.ops import linear_parts
    from attnchecker.inject.plan import check_op
    from attnchecker.models.protect import protect_
    from attnchecker.models.registry import role_of
    from attnchecker.models.source import example, make

    roles = [linear_parts(check_op(s))[0] for s in cfg.sites if s.startswith("linear:")]
    for family in cfg.families if roles else ():
        model = make(family, size=cfg.size, seed=cfg.seed, seq_len=cfg.seq_len)
        ids = torch.randint(3, 128, (1, cfg.seq_len))
        config = ABFTConfig(ops=(), scope="all_linear")  # every linear layer outside attention
        handle = protect_(model, config, example=example(model, ids))
        have = {(handle.state(n).layer, role_of(n)) for n in handle.modules
                if "y" in handle.state(n).hooks}  # fmt: skip
        want = {(layer, r) for r in roles for layer in cfg.faulty_layers}
        if missing := sorted(want - have):
            raise ConfigError(
                f"{family} has no linear layer (outside attention) at (layer, role) {missing}; "
                f"its linear layers: {sorted(have)}"
            )


def _drop_torn_tail(path: Path) -> None:
    """Cut a line left half-written by a killed run, so appending starts on a fresh line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _results(cfg: CampaignConfig, todo: list[dict[str, Any]]):
    jobs = [(cfg, s) for s in todo]
    if cfg.workers == 1:
        yield from map(_run_one, jobs)
        return
    with mp.get_context("spawn").Pool(cfg.workers) as pool:
        yield from pool.imap_unordered(_run_one, jobs, chunksize=4)


class Progress:
    """A progress bar over ``total`` units of work, when ``enabled`` (``with Progress(n, on)
    as advance:``, ``advance()`` once per unit); a no-op otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress as Bar

        self._bar = Bar()
        self._bar.start()
        task = self._bar.add_task("trials", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.stop()


def summarize(out: str | Path) -> dict[str, Any]:
    """Rates per family x site x kind x arm from the trial files alone (with the recovery arms,
    ``recovery``: each arm's outcomes as the user meets them, :data:`~attnchecker.inject.trial.
    USER_OUTCOMES`)."""
    rows = load_trials(Path(out))
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["family"], r["site"], r["kind"])].append(r)
    cells, recovery = [], []
    for (fam, site, kind), rs in sorted(groups.items()):
        for arm in ("unprotected", "protected"):
            outcomes = Counter(r[arm]["outcome"] for r in rs)
            cell = {"family": fam, "site": site, "kind": kind, "arm": arm, "trials": len(rs)}
            cell |= {f"{o}_rate": outcomes[o] / len(rs) for o in OUTCOMES}
            if arm == "protected":
                results = Counter(r[arm]["result"] for r in rs)
                cell |= {f"{x}_rate": results[x] / len(rs) for x in RESULTS}
            else:
                for where in ("scores", "context", "out", "next_input"):
                    cell[f"propagation_{where}"] = dict(
                        Counter(r[arm]["propagation"][where] for r in rs)
                    )
            cells.append(cell)
        for arm in RECOVERY_ARMS:
            if all(arm in r for r in rs):
                users = Counter(r[arm]["user"] for r in rs)
                rates = {u: users[u] / len(rs) for u in USER_OUTCOMES}
                recovery.append({"family": fam, "site": site, "kind": kind, "arm": arm,
                                 "trials": len(rs), "user_rates": rates})  # fmt: skip
    failing = [
        {k: r[k] for k in ("id", "family", "site", "kind", "pattern", "seed")}
        | {"result": r["protected"]["result"], "outcome": r["protected"]["outcome"]}
        for r in rows
        if r["protected"]["outcome"] != "masked"
        or r["protected"]["result"] in ("uncorrectable", "missed")
    ]
    return {
        "schema_version": SCHEMA_VERSION,
        "trials": len(rows),
        "cells": cells,
        "protected_failures": failing,
        **({"recovery": recovery} if recovery else {}),
    }
