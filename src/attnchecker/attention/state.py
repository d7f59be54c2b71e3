"""Per-module state of protected attention, split by concern, and the model's step clock.

One :class:`AttentionState` per protected module (an attention module, or with
``scope="all_linear"`` a linear layer) holds what it is (name, layer, config) and, each in its
own object, what it does: its named sites and their hooks (:class:`~.sites.Sites`), the record
store its checks write and the handle reads (:class:`~.records.Records`), the schedule shared by
the model's modules (:class:`~.schedule.Schedule`), what its projection checks leave for the core
(``pending``, ``handoff``: :mod:`~.projection`) and what really runs (:class:`Coverage`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor

from attnchecker.attention.config import ABFTConfig
from attnchecker.attention.impl import Impl, resolve
from attnchecker.attention.ops import CORE_OPS, GRAD_OPS, OPS
from attnchecker.attention.records import RECORD_FIELDS, Records, new_log
from attnchecker.attention.schedule import Schedule
from attnchecker.attention.sites import SiteCall, SiteHook, Sites, in_replay

T = TypeVar("T")

__all__ = [
    "RECORD_FIELDS",
    "AttentionState",
    "Clock",
    "Coverage",
    "SiteCall",
    "SiteHook",
    "StepMemo",
    "in_replay",
    "new_log",
]


class StepMemo:
    """What the checks compute once per step from tensors that do not change within it (a
    projection's weight sums for the registered ops, the SDPA route's mask facts): kept until
    the model's :class:`Clock` ticks (a fused optimizer updates parameters without bumping their
    version, which the tick covers), keyed by the tensors a value is made from, held (so an id
    is not reused within the step), with their storage and version (an in-place edit between
    calls is seen). Compiled code neither reads nor fills it (a read would be a guard)."""

    def __init__(self) -> None:
        self._memo: dict[tuple, tuple] = {}

    def get(self, key: tuple, of: tuple[Tensor | None, ...], make: Callable[[], T]) -> T:
        """``make()``, once per step for ``key`` and the tensors ``of``."""
        if torch.compiler.is_compiling():
            return make()
        full = (*key, *(None if t is None else _identity(t) for t in of))
        hit = self._memo.get(full)
        if hit is None:
            hit = self._memo[full] = (of, make())
        return hit[1]

    def clear(self) -> None:
        self._memo.clear()


def _identity(t: Tensor) -> tuple:
    """What a tensor is for the memo: its memory, layout and version (two views of one shard
    are one: a DTensor's ``to_local()`` is a fresh view each call); a shapes-only trace's fake
    tensors have no memory and are told apart by object."""
    if isinstance(t, FakeTensor):
        return id(t), t._version
    try:
        return t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t._version
    except RuntimeError:  # a wrapper subclass without storage of its own
        return id(t), t._version


_UPDATES = [0]
"""torch.optim steps taken in this process (a global step post-hook counts them)."""
_COUNTING: list = []


def _count_updates() -> None:
    """Count every torch.optim optimizer's steps from now on (one global hook a process)."""
    if not _COUNTING:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _COUNTING.append(register_optimizer_step_post_hook(_updated))


def _updated(optimizer, args, kwargs) -> None:
    _UPDATES[0] += 1


@dataclass
class Clock:
    """The step counter shared by all protected modules of one model, on the model's device,
    advanced by a root forward pre-hook (gradient checkpointing replays single layers, so it
    does not run then); compiled code never reads a Python int that changes every step.

    A float64 tensor of shape (1,): exact to 2^53 steps, and not 0-dim, because torch.compile
    drops in-place updates of 0-dim float64 CPU tensors held outside the graph (torch 2.13).

    Two memos: ``memo``, emptied at every tick (a forward's values: the SDPA route's mask
    facts), and ``weights`` (the weights' sums), emptied at the first tick after a torch.optim
    step, so micro-batches of one optimizer step (gradient accumulation) share one pass over
    each weight; until an optimizer has stepped between two of this clock's ticks (weights
    updated by hand, say), at every tick. An update outside torch.optim that bumps no version (a
    write into ``p.data``) in a model an optimizer also steps is not seen: its stale sums would
    flag every row, loudly."""

    count: Tensor
    memo: StepMemo = field(default_factory=StepMemo)  # emptied at every tick, in eager code
    weights: StepMemo = field(default_factory=StepMemo)  # emptied after an optimizer step
    updates: int = -1  # _UPDATES at the last tick
    stepped: bool = False  # an optimizer has stepped between two ticks

    def __post_init__(self) -> None:
        _count_updates()

    @property
    def step(self) -> int:
        """The current step as a Python int (one device sync: for boundaries, not the hot path)."""
        return int(self.count)

    def tick(self, device: torch.device) -> None:
        if self.count.device != device:  # the model moved after protect_ (a guard, not a sync)
            self.count = self.count.to(device)
        self.count.add_(1)
        if not torch.compiler.is_compiling():  # (compiled code does not read it)
            self.memo.clear()
            moved = _UPDATES[0] != self.updates
            if moved or not self.stepped:
                self.weights.clear()
            self.stepped |= moved and self.updates >= 0
            self.updates = _UPDATES[0]


@dataclass
class Coverage:
    """What really runs in one protected module, for ``summary()``: which engine runs the core
    (an :class:`~attnchecker.attention.engines.Engine`; None for a module without one: a linear
    layer) and why when it is not the one asked for, the reasons for which calls ran the eager
    engine instead (recorded in eager), and ``missing``: each op the config asks for that this
    module does not check, with the reason (projections not found, a layout not understood, a
    backward not reachable, a forward that took another path)."""

    engine: object | None = None  # (engines builds on this module: not imported here)
    note: str = ""
    fallbacks: set[str] = field(default_factory=set)
    missing: dict[str, str] = field(default_factory=dict)
    # the SDPA route's sampled rows at its last call (kernels.sdpa_sample.coverage), or None
    sampled: dict[str, object] | None = None

    @property
    def engine_name(self) -> str:
        """The engine's name (``"eager"`` for a module without a core)."""
        return "eager" if self.engine is None else self.engine.name

    @property
    def kernels(self) -> bool:
        """Whether the fused kernels run the core (their counters; they check it always)."""
        return self.engine is not None and self.engine.counters

    def miss(self, ops: Iterable[str], why: str) -> None:
        """Note ``ops`` as not checked, for ``why`` (the first reason given stays)."""
        for o in ops:
            self.missing.setdefault(o, why)


class AttentionState:
    """Attached to each protected module (a plain attribute, not a buffer, so ``state_dict()``
    and DDP's buffer broadcast never see it). ``ops`` / ``grad_ops``: its forward's and
    backward's checks (the rows of its records); ``backward``: its backward GEMMs are checked
    (a records sink); ``kernel_checks``: the fused kernels run its core (their counters);
    ``fixed_ops`` / ``role``: a linear layer's checks on every step, or its role in its block,
    whose schedule entries decide (:meth:`~.schedule.Schedule.bind`)."""

    def __init__(
        self,
        name: str,
        layer: int,
        config: ABFTConfig,
        clock: Clock,
        log: Tensor,
        *,
        ops: tuple[str, ...] = OPS,
        grad_ops: tuple[str, ...] = GRAD_OPS,
        schedule: Schedule | None = None,
        fixed_ops: tuple[str, ...] | None = None,
        role: str | None = None,
        backward: bool = False,
        kernel_checks: tuple[str, ...] = (),
    ) -> None:
        self.name, self.layer, self.config, self.clock = name, layer, config, clock
        # how its checks run on its device, resolved once (and again in follow())
        self.impl: Impl = resolve(config.check_impl, log.device)
        self.schedule = Schedule.of(config) if schedule is None else schedule
        self.schedule.bind(name, layer, fixed_ops, role)
        # a core op on any step of the schedule (bound once: only its phase changes later)
        asked = self.schedule.ops_of(name, on=True) | self.schedule.ops_of(name, on=False)
        self._core_asked = not asked.isdisjoint(CORE_OPS)
        self.sites = Sites((*ops, *grad_ops), name, layer, clock)
        self.records = Records(ops, grad_ops, log, backward=backward,
                               kernel_checks=kernel_checks)  # fmt: skip
        self.pending: list = []  # projection checks waiting for their group
        self.acc_out: object = None  # a linear layer's y checked by the accumulator GEMM
        self.handoff: object | None = None  # what the projection checks leave for the core
        # projections the module's attention function computes itself (projection.project:
        # nn.MultiheadAttention's in_proj_weight), as ProjectionSpecs
        self.inline: tuple = ()
        self.coverage = Coverage()
        # the checked core runs even where nothing needs it (attnchecker bench prices every
        # check on the checked engine: adaptive.profile.ENGINE)
        self.keep_core = False

    # -- what the engines ask

    def checks(self, op: str) -> bool:
        """Whether ``op`` is checked in this module now (the schedule's answer)."""
        return self.schedule.checks(self.name, op)

    def needs_core(self) -> bool:
        """Whether this module's attention must run the checked core: its schedule asks a core
        check (:data:`~.ops.CORE_OPS`) on any step, a hook is attached at a core site (a fault
        placed there), the fused kernels run it, or :attr:`keep_core` is set. Otherwise the
        model's own attention runs, untouched, and only its projections are checked."""
        if self._core_asked or self.keep_core or self.coverage.kernels:
            return True
        return any(self.hooks.get(op) for op in CORE_OPS)

    def site(self, site: str, tensor: Tensor) -> None:
        """Run the hooks attached to ``site`` on ``tensor``."""
        self.sites.run(site, tensor)

    def grad_hook(self):
        """The backward's site runner, or None (see :meth:`Sites.grad_hook`)."""
        return self.sites.grad_hook(self.records.grad_ops)

    def miss(self, ops: Iterable[str], why: str) -> None:
        """Note, in :attr:`coverage`, those of ``ops`` the schedule asks of this module on a
        checked step as not checked, for ``why``."""
        asked = self.schedule.ops_of(self.name, on=True)
        self.coverage.miss([o for o in ops if o in asked], why)

    def note(self, ops: tuple[str, ...], rec: Tensor) -> None:
        self.records.note(ops, rec)

    def commit(self) -> None:
        """Write the noted records to the log (:meth:`Records.commit`)."""
        noted = self.records.noted_device()
        if noted is not None:
            self.follow(noted)
        self.records.commit(self.clock.count, self.impl.region(torch.float64))

    def follow(self, device: torch.device) -> None:
        """Follow the module to ``device`` (moved after protect_, or a layer run alone): its
        records move there and its checks' implementation is resolved for it. Nothing when it
        is there already (a device comparison: no sync)."""
        if self.records.log.device != device:
            self.records.to(device)
            self.impl = resolve(self.config.check_impl, device)

    # -- read by users, tests and the injector

    @property
    def ops(self) -> tuple[str, ...]:
        return self.records.ops

    @property
    def grad_ops(self) -> tuple[str, ...]:
        return self.records.grad_ops

    @property
    def hooks(self) -> dict[str, list[SiteHook]]:
        """The sites this module has, and the hooks attached to each."""
        return self.sites.hooks

    @property
    def log(self) -> Tensor:
        return self.records.log

    @property
    def grads(self) -> Tensor | None:
        """The leaf whose ``.grad`` collects the backward checks' records, or None."""
        return self.records.sink

    @property
    def kernel(self) -> Tensor | None:
        """The fused kernels' forward counters, or None where they do not run this module."""
        return self.records.kernel

    @property
    def kernel_fault(self) -> object | None:
        """A fault the fused kernels' next calls inject (``kernels.KernelFault``, or a callable
        of (query, key) returning one or None)."""
        return self.sites.kernel_fault

    @kernel_fault.setter
    def kernel_fault(self, fault: object | None) -> None:
        self.sites.kernel_fault = fault
