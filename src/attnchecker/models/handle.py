"""``ProtectionHandle``: what protection touched, its counters, and its events."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import torch

from attnchecker.abft.tolerance import tf32_enabled
from attnchecker.attention import regions
from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.ops import ALL_OPS, CORE_GRAD_OPS, op_key
from attnchecker.attention.projection import settle
from attnchecker.attention.records import RECORD_FIELDS
from attnchecker.attention.schedule import Schedule
from attnchecker.attention.state import AttentionState, Clock, SiteHook
from attnchecker.errors import ConfigError, UncorrectableFaultError
from attnchecker.faults import kind_of
from attnchecker.kernels.launches import as_on_gpu
from attnchecker.recovery.ledger import DeviceLedger

if TYPE_CHECKING:
    from attnchecker.models.pending import Pending

PENDING = "pending discovery: found at the model's first forward (example= finds it at protect_)"
"""Why the configured ops of a module are not checked before a model of one's own, protected
without ``example=``, has run its first forward (:mod:`attnchecker.models.pending`)."""

__all__ = ["Event", "ProtectionHandle", "pattern_of"]

SCHEMA_VERSION = 3  # 3: Event.value and Event.quarantine (recovery.ledger)
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
    # the delivered value at the worst flagged position, where finite (None: INF / NaN, a fused
    # kernel's tile)
    value: float | None = None
    # True on the computation faults of the drain that names this device a quarantine candidate
    # (recovery.ledger: its rule and evidence, in summary()["quarantine"])
    quarantine: bool = False
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _count(into: dict[str, dict[str, int]], op: str, rec: dict[str, float]) -> None:
    """Add one record row (:data:`RECORD_FIELDS`) to the totals of ``op``."""
    c = into.setdefault(op, {"detected": 0, "corrected": 0, "uncorrectable": 0})
    det, lost = int(rec["detected"]), int(rec["lost"])
    c["detected"] += det
    c["uncorrectable"] += lost
    c["corrected"] += det - lost


def _coverage(st: AttentionState) -> dict[str, object]:
    """What really runs in one protected module (:class:`Coverage`), the ops it checks (on a
    schedule's checked steps; the fused kernels check the core's backward GEMMs) and, by op,
    why each op the config asks of it is not checked."""
    cov = st.coverage
    on = st.schedule.ops_of(st.name, on=True)
    kernels = cov.kernels
    checked = [
        op
        for op in (*st.ops, *st.grad_ops)
        if op in on
        and op not in cov.missing
        and (op in st.hooks or (kernels and op in CORE_GRAD_OPS))
    ]
    out = {
        "engine": cov.engine_name,
        "note": cov.note,
        "fallbacks": sorted(cov.fallbacks),
        "checked": checked,
        "unchecked": dict(cov.missing),
    }
    if "scores" in st.hooks:  # an attention module: whose attention runs now
        out["core"] = "checked" if st.needs_core() else "own"
    if cov.sampled is not None:  # the SDPA route's sampled rows (kernels.sdpa_sample.coverage)
        out["sampled"] = cov.sampled
    return out


def _configured(config: ABFTConfig) -> list[str]:
    """The ops a config asks for: its ``ops``, or those its schedule names."""
    if config.schedule is None:
        return list(config.ops)
    return sorted({op for _, op, _ in config.schedule}, key=op_key)


def _pending(config: ABFTConfig, pending: Pending) -> dict[str, dict[str, object]]:
    """``per_module`` before discovery: each module whose source names SDPA, the attention
    ops its config asks for pending."""
    ops = [op for op in _configured(config) if op in ALL_OPS]
    entry = {"engine": None, "note": "", "fallbacks": [], "checked": []}
    return {n: entry | {"unchecked": dict.fromkeys(ops, PENDING)} for n in pending.candidates}


def _event(module: str, layer: int, op: str, rec: dict[str, float], *, tile: bool) -> Event:
    """The event of one record row that detected (``tile``: a fused kernel's counters)."""
    n = int(rec["detected"])
    n_rows, n_cols = int(rec["n_rows"]), int(rec["n_cols"])
    pattern = "tile" if tile else pattern_of(n_rows, n_cols)
    action = "uncorrectable" if rec["lost"] else "recomputed" if pattern == "2D" else "corrected"
    kind = "unknown" if tile else kind_of(rec["value"])
    cause = "numerics" if rec["reproduced"] else "fault"
    step = round(rec["step_sum"] / n)
    value = None if tile or not math.isfinite(rec["value"]) else float(rec["value"])
    return Event(step, module, layer, op, pattern, kind, action, n_rows, n_cols, count=n,
                 cause=cause, value=value)  # fmt: skip


class _Detach:
    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn

    def remove(self) -> None:
        self._fn()


class ProtectionHandle:
    """Returned by :func:`attnchecker.protect_`; one per protected model."""

    def __init__(
        self,
        config: ABFTConfig,
        states: dict[str, AttentionState],
        clock: Clock,
        schedule: Schedule | None = None,
        *,
        undo: list[Callable[[], None]] | None = None,
        unprotected: str | None = None,
    ) -> None:
        self.config = config
        self._states = states
        self._clock = clock
        self.schedule = Schedule.of(config) if schedule is None else schedule
        self._undo: list[Callable[[], None]] = [] if undo is None else undo  # what protect_ did
        self._totals = {op: {"detected": 0, "corrected": 0, "uncorrectable": 0} for op in ALL_OPS}
        self.skip_requested = False
        self.read_also: list[float] = []  # drain(also=...)'s values
        self._causes = {"fault": 0, "numerics": 0}  # detections by cause since protection
        self._engines_logged: set[str] | None = None  # fallback reasons logged; None: none yet
        self.unprotected = unprotected  # why the model's attention is not checked, or None
        # a model of one's own protected without example=, before its first forward
        self._pending: Pending | None = None
        # per device, the checks that fired and whether it is a quarantine candidate
        self.devices = DeviceLedger()
        # checks beyond the GEMMs (ABFTConfig.invariants): the norms' (models.norms) and the
        # guarded optimizer's update check (recovery.update_check), read with the drain
        self.invariants: list = []
        self._settled: list[Event] = []  # events an earlier settle() read, for the next drain
        self._inv_values: list[list[float]] = []  # the invariants' last read, and its step
        self._inv_step = 0

    @property
    def modules(self) -> list[str]:
        """Qualified names of the protected modules (none before the first forward of a model
        protected without ``example=``: :attr:`pending`)."""
        return list(self._states)

    @property
    def pending(self) -> bool:
        """Whether discovery waits for the model's first forward (no ``example=``)."""
        return self._pending is not None

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
        if self._pending is not None:
            raise ConfigError(
                "protection is found at the model's first forward (no example= given); "
                "attach after it, or pass example=(batch,) to protect_"
            )
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

    def _read(self, also: torch.Tensor | None = None) -> list[list[dict[str, float]]]:
        """Every module's records (:meth:`Records.rows`, a dict of :data:`RECORD_FIELDS` per
        row) as Python values: one device transfer, which also reads ``also`` (a small tensor
        of the caller's) into :attr:`read_also`."""
        states = list(self._states.values())
        dev = self._clock.count.device
        rows = [st.records.rows(self._clock.count).to(dev) for st in states]
        extra = [] if also is None else [also.detach().reshape(-1).to(dev, torch.float64)]
        inv = self._invariant_tensors()
        if not rows and not extra and not inv:
            return []
        values = torch.cat([r.flatten().double() for r in rows] + inv + extra).tolist()
        if extra:
            self.read_also = values[len(values) - extra[0].numel() :]
        self._take_invariants(values, sum(r.numel() for r in rows), inv)
        at, out = 0, []
        width = len(RECORD_FIELDS)
        for r in rows:
            out.append([dict(zip(RECORD_FIELDS, values[at + i * width : at + (i + 1) * width],
                                 strict=True)) for i in range(r.shape[0])])  # fmt: skip
            at += r.numel()
        return out

    def mark(self) -> tuple[torch.Tensor, int]:
        """Where the step about to run starts (the clock, on the device: no host read; the
        schedule's drains), for :meth:`rewind`."""
        return self._clock.count.clone(), self.schedule.drains

    def rewind(self, mark: tuple[torch.Tensor, int]) -> None:
        """Back to ``mark`` (:meth:`mark`, taken before a step whose drain is done): a replay
        of that step runs the checks it ran, and its events report its step."""
        count, drains = mark
        self._clock.count.copy_(count)
        self.schedule.go_to(drains)
        self.devices.rewound()  # the next drain is the replay's

    def counters(self) -> dict[str, dict[str, int]]:
        """Totals per op since protection (checkpointing replays where they found something the
        first pass did not), and per fused-kernel check (:data:`attnchecker.kernels.CHECKS`)."""
        out = {op: dict(c) for op, c in self._totals.items()}
        records = self._read()
        for st, recs in zip(self._states.values(), records, strict=True):
            for op, rec in zip(st.records.names, recs, strict=True):
                _count(out, op, rec)
        return out

    def found_inf(self) -> torch.Tensor:
        """1.0 (a float32 0-dim tensor on the model's device) when an uncorrectable error was
        recorded since the last drain, else 0.0, with no host synchronisation: hand it to a
        fused optimizer (``opt.found_inf = handle.found_inf()`` before ``opt.step()``, as
        GradScaler does) to skip the update on the device. Call it after the backward."""
        total = self._clock.count.new_zeros(())
        for st in self._states.values():
            settle(st)
            total = total + st.records.lost().to(total.device)
        return (total > 0).to(torch.float32)

    def drain(self, *, also: torch.Tensor | None = None) -> list[Event]:
        """Events recorded since the last drain (one host sync), with the policy applied:
        ``raise`` raises :class:`UncorrectableFaultError` on an uncorrectable event (carrying
        every event of this drain as ``.events``), ``warn``
        warns, ``skip_step`` and ``replay`` set :attr:`skip_requested` for the training loop to
        honour (a loop that replays, :class:`~attnchecker.recovery.replay.Replayer`, replays
        first).
        The fused kernels' detections are one event per check that detected (pattern "tile":
        the kernels count tiles and programs, not rows; kind "unknown"), at the step of the
        drain. Advances the schedule: the next step is the (drains + 1)-th. ``also``: a small
        tensor read in the same transfer, into :attr:`read_also` (a flag a loop decides on,
        without a second host sync)."""
        for st in self._states.values():
            settle(st)  # projections whose group never completed (eager only)
        tf32_enabled()  # the matmul precision, read in eager code for the compiled checks
        self.skip_requested = False
        self._log_engines()
        records = self._read(also)
        self.schedule.advance()
        events = []
        for (name, st), recs in zip(self._states.items(), records, strict=True):
            st.records.reset()
            kernel = set(st.records.kernel_checks)
            for op, rec in zip(st.records.names, recs, strict=True):
                n = int(rec["detected"])
                if n:
                    _count(self._totals, op, rec)
                    events.append(_event(name, st.layer, op, rec, tile=op in kernel))
        events = self._settled + events + self._invariant_events()
        self._settled = []
        for e in events:
            self._causes[e.cause] = self._causes.get(e.cause, 0) + e.count
        events = self._name_device(events)
        bad = [e for e in events if e.action == "uncorrectable"]
        if bad:
            self._apply_policy(bad, events)
        return events

    def _invariant_events(self) -> list[Event]:
        """The invariants' events from the values :meth:`_read` read (their repairs, on the
        fault path only, happen here: :mod:`attnchecker.recovery.update_check`)."""
        out = []
        if as_on_gpu():  # the cost model's trace: garbage values; the clean path is priced
            self._inv_values = [[0.0] * len(v) for v in self._inv_values]
        for inv, values in zip(self.invariants, self._inv_values, strict=False):
            for e in inv.events(values, self._inv_step):
                out.append(Event(**e))
                _count(self._totals, e["op"], {"detected": 1,
                       "lost": float(e["action"] == "uncorrectable")})  # fmt: skip
        self._inv_values = []
        return out

    def settle(self) -> list[Event]:
        """Read (one host transfer) and repair what an invariant flagged since the last drain,
        when one has something pending (the update check, after the optimizer's step): the
        root's forward pre-hook calls it, so a repaired parameter is in place before the next
        forward. Its events come with the next :meth:`drain` (and are returned)."""
        if not any(getattr(i, "pending", False) for i in self.invariants):
            return []
        inv = self._invariant_tensors()
        self._take_invariants(torch.cat(inv).tolist(), 0, inv)  # one transfer
        found = self._invariant_events()
        self._settled += found
        return found

    def _invariant_tensors(self) -> list[torch.Tensor]:
        """What a read of the invariants transfers: each one's counts, then the clock (their
        events' step); nothing without invariants."""
        dev = self._clock.count.device
        inv = [i.tensor().detach().reshape(-1).to(dev, torch.float64) for i in self.invariants]
        return [*inv, self._clock.count.detach().reshape(-1).double()] if inv else []

    def _take_invariants(self, values: list[float], at: int, inv: list[torch.Tensor]) -> None:
        """The invariants' values and the step, from ``values`` read from ``at`` on."""
        self._inv_values = []
        for t in inv[:-1]:
            self._inv_values.append(values[at : at + t.numel()])
            at += t.numel()
        self._inv_step = int(values[at]) if inv else 0

    def _name_device(self, events: list[Event]) -> list[Event]:
        """The ledger fed with this drain's events (:mod:`attnchecker.recovery.ledger`); the
        events, their computation faults marked ``quarantine`` where its rule first holds (no
        event of its own: a drain returns one event per op that found something)."""
        from attnchecker.recovery.diagnosis import here

        if not events and self.devices.idle:  # the clean path: no host work
            return events
        where = here(self._clock.count.device)
        named = self.devices.observe(events, where)
        if named is None:
            return events
        _LOG.warning("attnchecker: %s", named.message())
        return [replace(e, quarantine=True) if e.cause == "fault" else e
                for e in events]  # fmt: skip

    def _log_engines(self) -> None:
        """At the first drain, one log line per engine saying which modules it runs and why
        (when it is not the one asked for) and one warning per module with configured ops it
        does not check; later, a warning for each new fused fallback."""
        if self._engines_logged is None and self._states:
            self._engines_logged = set()
            for name, st in self._states.items():
                if missing := _coverage(st)["unchecked"]:
                    _LOG.warning(
                        "attnchecker: %s does not check %s",
                        name, "; ".join(f"{op} ({why})" for op, why in missing.items()),
                    )  # fmt: skip
            groups: dict[tuple[str, str], list[str]] = {}
            for name, st in self._states.items():
                groups.setdefault((st.coverage.engine_name, st.coverage.note), []).append(name)
            for (engine, note), names in groups.items():
                _LOG.info(
                    "attnchecker: engine %s for %d module(s) (%s)%s",
                    engine, len(names), ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""),
                    f": {note}" if note else "",
                )  # fmt: skip
        for name, st in self._states.items():
            for reason in st.coverage.fallbacks - (self._engines_logged or set()):
                self._engines_logged.add(reason)
                _LOG.warning(
                    "attnchecker: the %s engine fell back to the eager engine in %s (and maybe "
                    "others): %s; handle.summary()['per_module'] lists them",
                    st.coverage.engine_name, name, reason,
                )  # fmt: skip

    def _apply_policy(self, bad: list[Event], events: list[Event]) -> None:
        msg = f"{len(bad)} uncorrectable error(s), first: {bad[0]}"
        if self.config.policy == "raise":  # the events go with it (the logs are reset)
            raise UncorrectableFaultError(msg, events)
        if self.config.policy == "warn":
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
        self.skip_requested = self.config.policy in ("skip_step", "replay")

    def summary(self) -> dict[str, object]:
        """Protected modules, checked ops, steps, counters, and where this process runs with
        its detections by cause (computation ``fault`` / ``numerics``: see
        :mod:`attnchecker.recovery.diagnosis`; :func:`~attnchecker.recovery.diagnosis.gather`
        collects them over ranks), as plain data."""
        from attnchecker.abft.tolerance import reduced_reductions
        from attnchecker.recovery.diagnosis import here

        where = here(self._clock.count.device)
        return {
            "modules": self.modules,
            # None, or why the attention is not checked (scope="all_linear" on a model whose
            # attention protect_ cannot find: its linear layers alone are)
            "attention": PENDING if self._pending is not None else self.unprotected,
            "ops": _configured(self.config),
            "schedule": None if self.config.schedule is None else list(self.config.schedule),
            "scope": self.config.scope,
            "mode": self.config.mode,
            # how the checks run from eager code (attention.regions: the config's choice, and per
            # check region what ran in this process: compiled, eager, a failed compile's eager)
            "check_impl": self.config.check_impl,
            # the GEMM checks' rounding-tight bound (abft.tolerance.gemm_terms) holds on CUDA for
            # the half dtypes whose split-K reductions are exact; the others see extreme errors
            "reduced_precision_reductions": reduced_reductions()
            if where.device.startswith("cuda")
            else [],
            "check_regions": regions.describe(),
            # check_impl="accumulator": which GEMMs are checked on their fp32 accumulator, which
            # on their delivered outputs, and what neither sees (None: not asked for)
            "accumulator": _accumulator(self.config, self._states),
            "steps": self.step,
            "counters": self.counters(),
            "rank": where.rank,
            "host": where.host,
            "device": where.device,
            "detections": dict(self._causes),
            # per device, the checks that fired (where, at what size, at which steps, replays)
            # and the evidence naming a quarantine candidate (recovery.ledger: the rule)
            "devices": self.devices.to_dicts(),
            "quarantine": [r.evidence() for r in self.devices.candidates()],
            # per module: its engine, the ops it checks, those it does not and why, and for an
            # attention module its "core": "checked", or "own" (nothing needs the checked core:
            # the model's own attention runs, untouched)
            "per_module": _pending(self.config, self._pending)
            if self._pending is not None
            else {name: _coverage(st) for name, st in self._states.items()},
            # the checks beyond the GEMMs asked for (ABFTConfig.invariants): per check, what it
            # covers and what it does not, and why
            "invariants": {i.op: i.summary() for i in self.invariants}
            | {op: {"checked": False, "why_not": _NOT_YET[op]}
               for op in self.config.invariants
               if op in _NOT_YET and op not in {i.op for i in self.invariants}},
        }

    def _remove(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


_NOT_YET = {"update": "no guarded optimizer yet: attnchecker.guard(optimizer, handle) checks "
                      "the update"}


def _accumulator(config, states) -> dict[str, object] | None:
    """``summary()["accumulator"]``: what ``check_impl="accumulator"`` covers in this process."""
    if config.check_impl != "accumulator":
        return None
    on = any(st.impl.accumulator for st in states.values())
    return {
        "running": on,  # False: the kernels cannot run here (no CUDA, no interpreter)
        "on_the_accumulator": ["q", "k", "v", "out", "y (all_linear)", "dx", "dw"] if on else [],
        "on_delivered_outputs": [
            "projections whose sites interleave, or that are a packed Parameter "
            "(nn.MultiheadAttention's in_proj)",
            "the attention core's checks",
        ]
        if on
        else ["every GEMM check"],
        "unseen": "an error after a GEMM's epilogue (its store, memory): its checksums were "
        "taken from the accumulator, and the next GEMM's checksums follow their operands",
    }
