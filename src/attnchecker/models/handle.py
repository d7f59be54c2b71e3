"""``ProtectionHandle``: what protection touched, its counters, and its events."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from attnchecker.abft import regions
from attnchecker.abft.eec import NEAR_INF
from attnchecker.attention.config import ALL_OPS, ABFTConfig
from attnchecker.attention.grads import CORE_GRAD_OPS
from attnchecker.attention.state import RECORD_FIELDS, AttentionState, Clock, SiteHook
from attnchecker.errors import ConfigError, UncorrectableFaultError

__all__ = ["Event", "ProtectionHandle", "pattern_of"]

SCHEMA_VERSION = 2
_LOG = logging.getLogger("attnchecker")


def pattern_of(n_rows: int, n_cols: int) -> str:
    """0D (one element), 1R (one row), 1C (one column), 2D (several of both)."""
    if n_rows <= 1 and n_cols <= 1:
        return "0D"
    if n_rows <= 1:
        return "1R"
    if n_cols <= 1:
        return "1C"
    return "2D"


@dataclass(frozen=True)
class Event:
    """What one op of one protected module found since the last drain. ``action``: corrected
    (0D / 1R / 1C rebuilt from the operands), recomputed (a 2D pattern, its rows or heads
    recomputed) or uncorrectable. ``count`` checks detected something; pattern, kind and step
    describe them when ``count`` is 1 (with several, the step is their mean and the sizes sums).
    Projections: rows are tokens, columns output features. Scores, probabilities and context are
    checked by rows alone, which cannot tell an element from a row: ``n_rows`` = ``n_cols`` =
    the flagged query rows, so their pattern is 0D (one row) or 2D (several)."""

    step: int
    module: str
    layer: int
    op: str
    pattern: str
    kind: str
    action: str
    n_rows: int
    n_cols: int
    # kept for schema 2 readers, always False: a checkpointing replay's detections are counted
    # with their step where they differ from the first pass's (AttentionState.commit)
    replay: bool = False
    count: int = 1
    # "fault": the GEMM's output disagreed with its operands (a computation fault); "numerics":
    # recomputing from the operands gave the flagged result again, so they imply it (an
    # overflow upstream: not this GEMM's hardware)
    cause: str = "fault"
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def kind_of(value: float) -> str:
    """What a delivered value looked like: inf, -inf, nan, near_inf (|x| >= 1e10) or finite
    (the spelling of ``attnchecker.inject.kinds.FaultKind``)."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return "near_inf" if abs(value) >= NEAR_INF else "finite"


def _count(into: dict[str, int], row: list[float]) -> None:
    rec = dict(zip(RECORD_FIELDS, row, strict=True))
    det, lost = int(rec["detected"]), int(rec["lost"])
    into["detected"] += det
    into["uncorrectable"] += lost
    into["corrected"] += det - lost


def _zero() -> dict[str, int]:
    return {"detected": 0, "corrected": 0, "uncorrectable": 0}


def _checks() -> tuple[str, ...]:
    from attnchecker.kernels.flash import CHECKS

    return CHECKS


def _coverage(st: AttentionState, config: ABFTConfig) -> dict[str, object]:
    """What really runs in one protected module (:class:`Coverage`) and the ops it checks (on
    a schedule's checked steps; the fused kernels check the core's backward GEMMs)."""
    cov = st.coverage
    on = (
        st.phases[1]
        if st.phases is not None
        else (config.ops if st.checked is None else st.checked)
    )
    kernels = cov.engine == "triton"
    checked = [
        op
        for op in (*st.ops, *st.grad_ops)
        if op in on and (op in st.hooks or (kernels and op in CORE_GRAD_OPS))
    ]
    return {
        "engine": cov.engine,
        "note": cov.note,
        "fallbacks": sorted(cov.fallbacks),
        "checked": checked,
        "unchecked": list(cov.unwired),
    }


class _Detach:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def remove(self) -> None:
        self._fn()


class ProtectionHandle:
    """Returned by :func:`attnchecker.protect_`; one per protected model."""

    def __init__(self, config: ABFTConfig, states: dict[str, AttentionState], clock: Clock) -> None:
        self.config = config
        self._states = states
        self._clock = clock
        self._undo: list[Callable[[], None]] = []
        self._totals = {op: {"detected": 0, "corrected": 0, "uncorrectable": 0} for op in ALL_OPS}
        self.skip_requested = False
        self._causes = {"fault": 0, "numerics": 0}  # detections by cause since protection
        self._engines_logged: set[str] | None = None  # fallback reasons logged; None: none yet
        self._drains = 0  # the schedule's period counts these (not forwards: the clock's ticks)

    @property
    def modules(self) -> list[str]:
        """Qualified names of the protected attention modules."""
        return list(self._states)

    @property
    def step(self) -> int:
        """Forward passes of the model seen so far (one per training step; a device read)."""
        return self._clock.step

    def state(self, module: str) -> AttentionState:
        return self._states[module]

    def attach(
        self,
        hook: SiteHook,
        *,
        sites: Iterable[str] | None = None,
        modules: Iterable[str] | None = None,
    ) -> _Detach:
        """Run ``hook`` at the named ``sites`` of the given protected ``modules`` (all by default;
        a site a module does not have, such as ``dx.k`` of a fused Q|K|V projection, is skipped).

        The hook sees each site's tensor between the operation and its check and may edit it in
        place: this is how faults are placed. Returns an object whose ``remove()`` detaches it.
        """
        known_all = [s for st in self._states.values() for s in st.hooks]
        sites = list(dict.fromkeys(known_all)) if sites is None else list(sites)
        known = {s for st in self._states.values() for s in st.hooks}
        if unknown := sorted(set(sites) - known):
            raise ConfigError(f"unknown sites {unknown}; choose from {sorted(known)}")
        names = self.modules if modules is None else list(modules)
        if unknown := sorted(set(names) - set(self._states)):
            raise ConfigError(f"not protected modules: {unknown}")
        targets = [
            self._states[n].hooks[s] for n in names for s in sites if s in self._states[n].hooks
        ]
        for lst in targets:
            lst.append(hook)

        def detach() -> None:
            for lst in targets:
                if hook in lst:
                    lst.remove(hook)

        return _Detach(detach)

    def _read(self) -> tuple[list[list[list[float]]], list[list[list[float]]], int]:
        """Every module's log, the fused kernels' counters and the step, as Python values (the
        one device sync)."""
        if not self._states:
            return [], [], 0
        states = list(self._states.values())
        dev = states[0].log.device
        # per module: its forward ops' rows, then its backward ops' rows
        logs = [torch.cat([st.log.to(dev), st.grad_records().to(dev)]) for st in states]
        kern = [c.to(dev) for st in states if (c := st.kernel_counts()) is not None]
        parts = [*(g.flatten() for g in logs), self._clock.count.to(dev, torch.float64)]
        if kern:
            parts.append(torch.stack(kern).flatten().to(torch.float64))
        flat = torch.cat(parts).tolist()
        log_rows, at = [], 0
        for g in logs:
            rows, width = g.shape
            log_rows.append([flat[at + i * width : at + (i + 1) * width] for i in range(rows)])
            at += g.numel()
        kern_rows = torch.tensor(flat[at + 1 :]).view(len(kern), -1, 3).tolist() if kern else []
        return log_rows, kern_rows, int(flat[at])

    def counters(self) -> dict[str, dict[str, int]]:
        """Totals per op since protection (checkpointing replays where they found something the
        first pass did not), and per fused-kernel check (:data:`attnchecker.kernels.flash.CHECKS`)
        under ``fused``."""
        out = {op: dict(c) for op, c in self._totals.items()}
        logs, kern, _ = self._read()
        for st, log in zip(self._states.values(), logs, strict=True):
            for op, row in zip((*st.ops, *st.grad_ops), log, strict=True):
                _count(out.setdefault(op, _zero()), row)
        for rows in kern:
            for check, (det, corr, unc) in zip(_checks(), rows, strict=True):
                c = out.setdefault(check, {"detected": 0, "corrected": 0, "uncorrectable": 0})
                c["detected"] += int(det)
                c["corrected"] += int(corr)
                c["uncorrectable"] += int(unc)
        return out

    def found_inf(self) -> torch.Tensor:
        """1.0 (a float32 0-dim tensor on the model's device) when an uncorrectable error was
        recorded since the last drain, else 0.0, with no host synchronisation: hand it to a
        fused optimizer (``opt.found_inf = handle.found_inf()`` before ``opt.step()``, as
        GradScaler does) to skip the update on the device. Call it after the backward."""
        lost_field = RECORD_FIELDS.index("lost")
        total = self._clock.count.new_zeros(())
        for st in self._states.values():
            st.flush()
            st.commit()
            total = total + st.log[:, lost_field].sum().to(total.device)
            if st.grads is not None and st.grads.grad is not None:
                total = total + st.grads.grad[:, lost_field].sum().to(total.device)
            kern = st.kernel_counts()
            if kern is not None:
                total = total + kern[:, 2].sum().to(total.device)
        return (total > 0).to(torch.float32)

    def drain(self) -> list[Event]:
        """Events recorded since the last drain (one host sync), with the policy applied:
        ``raise`` raises :class:`UncorrectableFaultError` on an uncorrectable event (carrying
        every event of this drain as ``.events``), ``warn``
        warns, ``skip_step`` sets :attr:`skip_requested` for the training loop to honour.
        The fused kernels' detections are one event per check that detected (pattern "tile":
        the kernels count tiles and programs, not rows), at the step of the drain."""
        self._drains += 1
        for st in self._states.values():
            st.flush()  # projections whose group never completed (eager only)
            st.commit()
        self.skip_requested = False
        self._log_engines()
        logs, kern, step_now = self._read()
        if not logs:
            return []
        # the next training step, the (drains + 1)-th, is a checked one: 1, 1 + period, ...
        on = self._drains % self.config.period == 0
        for st in self._states.values():
            st.log.zero_()
            st.reset_kernel_counts()
            if st.grads is not None:
                st.grads.grad = None
            if st.phases is not None:
                st.checked = st.phases[on]
        events = []
        for (name, st), log in zip(self._states.items(), logs, strict=True):
            for op, row in zip((*st.ops, *st.grad_ops), log, strict=True):
                rec = dict(zip(RECORD_FIELDS, row, strict=True))
                n = int(rec["detected"])
                if not n:
                    continue
                _count(self._totals.setdefault(op, _zero()), row)
                n_rows, n_cols = int(rec["n_rows"]), int(rec["n_cols"])
                pattern = pattern_of(n_rows, n_cols)
                if rec["lost"]:
                    action = "uncorrectable"
                else:
                    action = "recomputed" if pattern == "2D" else "corrected"
                step = round(rec["step_sum"] / n)
                cause = "numerics" if rec["reproduced"] else "fault"
                events.append(
                    Event(step, name, st.layer, op, pattern, kind_of(rec["value"]), action,
                          n_rows, n_cols, count=n, cause=cause)
                )  # fmt: skip
        fused = [(name, st) for name, st in self._states.items() if st.kernel is not None]
        for (name, st), rows in zip(fused, kern, strict=True):
            for check, (det, corr, unc) in zip(_checks(), rows, strict=True):
                if not det:
                    continue
                tot = self._totals.setdefault(
                    check, {"detected": 0, "corrected": 0, "uncorrectable": 0}
                )
                tot["detected"] += int(det)
                tot["corrected"] += int(corr)
                tot["uncorrectable"] += int(unc)
                action = "uncorrectable" if unc else "corrected"
                events.append(
                    Event(step_now, name, st.layer, check, "tile", "unknown", action, int(det), 0,
                          count=int(det))
                )  # fmt: skip
        for e in events:
            self._causes[e.cause] = self._causes.get(e.cause, 0) + e.count
        bad = [e for e in events if e.action == "uncorrectable"]
        if bad:
            self._apply_policy(bad, events)
        return events

    def _log_engines(self) -> None:
        """At the first drain, one log line per engine saying which modules it runs and why
        (when it is not the one asked for); later, a warning for each new fused fallback."""
        if self._engines_logged is None:
            self._engines_logged = set()
            groups: dict[tuple[str, str], list[str]] = {}
            for name, st in self._states.items():
                groups.setdefault((st.coverage.engine, st.coverage.note), []).append(name)
            for (engine, note), names in groups.items():
                _LOG.info(
                    "attnchecker: engine %s for %d module(s) (%s)%s",
                    engine, len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""),
                    f": {note}" if note else "",
                )  # fmt: skip
        for name, st in self._states.items():
            for reason in st.coverage.fallbacks - self._engines_logged:
                self._engines_logged.add(reason)
                _LOG.warning(
                    "attnchecker: fused kernels fell back to the eager engine in %s (and maybe "
                    "others): %s; handle.summary()['per_module'] lists them",
                    name, reason,
                )  # fmt: skip

    def _apply_policy(self, bad: list[Event], events: list[Event]) -> None:
        msg = f"{len(bad)} uncorrectable error(s), first: {bad[0]}"
        if self.config.policy == "raise":  # the events go with it (the logs are reset)
            raise UncorrectableFaultError(msg, events)
        if self.config.policy == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self.skip_requested = self.config.policy == "skip_step"

    def summary(self) -> dict[str, object]:
        """Protected modules, checked ops, steps, counters, and where this process runs with
        its detections by cause (computation ``fault`` / ``numerics``: see
        :mod:`attnchecker.recovery.diagnosis`; :func:`~attnchecker.recovery.diagnosis.gather`
        collects them over ranks), as plain data."""
        from attnchecker.recovery.diagnosis import here

        where = here(self._clock.count.device)
        return {
            "modules": self.modules,
            "ops": list(self.config.ops)
            if self.config.schedule is None
            else sorted({op for _, op, _ in self.config.schedule}, key=ALL_OPS.index),
            "schedule": None if self.config.schedule is None else list(self.config.schedule),
            "scope": self.config.scope,
            "mode": self.config.mode,
            # how the checks run from eager code (abft.regions: the config's choice, and per
            # check region what ran in this process: compiled, eager, a failed compile's eager)
            "check_impl": self.config.check_impl,
            "check_regions": regions.describe(),
            "steps": self.step,
            "counters": self.counters(),
            "rank": where.rank,
            "host": where.host,
            "device": where.device,
            "detections": dict(self._causes),
            "per_module": {name: _coverage(st, self.config) for name, st in self._states.items()},
        }

    def _remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
