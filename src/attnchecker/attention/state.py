"""Per-module state of protected attention: named sites, the step clock and the device log.

Nothing a check writes during a step is a Python value: the step counter is a tensor advanced
on the device, and each check adds its record to a small float64 tensor (the *log*, one row per
op) with in-place tensor ops. A compiled model therefore sees no Python int or list that changes
from step to step (dynamo would guard on it and recompile), and the clean path never
synchronises with the device; :class:`~attnchecker.models.handle.ProtectionHandle` reads every
log with one transfer when it drains.

A record is the float64 vector :data:`RECORD_FIELDS`, summed into its op's row of the log:
``detected`` and ``lost`` count checks, the others are summed over detecting checks only (so for
one detection between two drains they are that detection's values, and ``step_sum / detected``
is the mean step of several).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnchecker.abft import regions
from attnchecker.attention.checks import (
    Projection,
    detected,
    log_rows,
    projection_check_,
    row_factor,
    row_floor,
)
from attnchecker.attention.config import GRAD_OPS, OPS, ABFTConfig
from attnchecker.attention.handoff import Handoff
from attnchecker.errors import UnsupportedModelError

__all__ = [
    "RECORD_FIELDS",
    "AttentionState",
    "Clock",
    "Coverage",
    "SiteCall",
    "SiteHook",
    "in_replay",
    "new_log",
]

RECORD_FIELDS = ("n_rows", "n_cols", "value", "lost", "reproduced", "detected", "step_sum")
"""One check's record: flagged rows / columns of its unit (tokens and features for a projection;
query rows, twice, for attention), the delivered value at the worst flagged position, whether a
detection was left unrepaired (beyond the repair budget, or the operands were already bad),
whether recomputing from the operands gave a flagged result again (the operands imply it:
numerics, not this GEMM), whether it detected, and the step. The first five are the checks' own
records, in order."""


def in_replay() -> bool:
    """True while autograd runs a node: a forward running now is a checkpointing replay.
    Always False under torch.compile, which does not replay Python code."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_autograd_node() is not None


@dataclass
class Clock:
    """The step counter shared by all protected modules of one model, on the model's device,
    advanced by a root forward pre-hook (gradient checkpointing replays single layers, so it
    does not run then); compiled code never reads a Python int that changes every step.

    A float64 tensor of shape (1,): exact to 2^53 steps, and not 0-dim, because torch.compile
    drops in-place updates of 0-dim float64 CPU tensors held outside the graph (torch 2.13)."""

    count: Tensor

    @property
    def step(self) -> int:
        """The current step as a Python int (one device sync: for boundaries, not the hot path)."""
        return int(self.count)

    def tick(self, device: torch.device) -> None:
        if self.count.device != device:  # the model moved after protect_ (a guard, not a sync)
            self.count = self.count.to(device)
        self.count.add_(1)


@dataclass
class SiteCall:
    """What a site hook receives. Edit ``tensor`` in place (or return a replacement)."""

    site: str
    tensor: Tensor
    module: str
    layer: int
    replay: bool
    clock: Clock = field(repr=False)

    @property
    def step(self) -> int:
        """Forward passes of the model so far, counting this one (reads the device clock)."""
        return self.clock.step


SiteHook = Callable[[SiteCall], "Tensor | None"]


@dataclass
class Coverage:
    """What really runs in one protected module, for ``summary()``: which engine runs the core
    ("eager" or "triton") and why when it is not the one asked for, the reasons for which fused
    calls ran the eager engine instead (recorded in eager), and the ops the config asks for
    that this module has but cannot check (a Linear with a forward of its own)."""

    engine: str = "eager"
    note: str = ""
    fallbacks: set[str] = field(default_factory=set)
    unwired: list[str] = field(default_factory=list)


@dataclass
class AttentionState:
    """Attached to each protected attention module (a plain attribute, not a buffer, so
    ``state_dict()`` and DDP's buffer broadcast never see it)."""

    name: str
    layer: int
    config: ABFTConfig
    clock: Clock
    log: Tensor  # (len(ops), len(RECORD_FIELDS)) float64, on the module's device
    hooks: dict[str, list[SiteHook]] = field(default_factory=dict)
    # the forward's and the backward's op names: the rows of ``log`` and of ``grads.grad``
    ops: tuple[str, ...] = OPS
    grad_ops: tuple[str, ...] = GRAD_OPS
    # the leaf whose .grad collects the backward checks' records (attention.grads), or None
    grads: Tensor | None = None
    checked: frozenset[str] | None = None  # the ops checked, when not the config's (a linear)
    # a schedule's (off-step, on-step) ops of this layer; the handle switches ``checked``
    # between these two objects at each drain (a compiled model guards on them: two graphs)
    phases: tuple[frozenset[str], frozenset[str]] | None = None
    pending: list = field(default_factory=list)  # projection checks waiting for their group
    handoff: object | None = None  # what the projection checks leave for the core (passing)
    noted: list = field(default_factory=list)  # this layer's records, until commit()
    # the records of the last first pass (not a replay) per committed op tuple: what a
    # checkpointing replay's records are compared with (eager only)
    first_pass: dict = field(default_factory=dict)
    # the fused backend: its kernels' device counters (kernels.flash.CHECKS x detected,
    # corrected, uncorrected) of the forward, and of the backward in kernel_sink.grad
    # (kernels.ops), and a fault its next calls inject (tests, campaigns)
    kernel: Tensor | None = None
    kernel_sink: Tensor | None = None  # its .grad collects the backward kernels' counters
    kernel_fault: object | None = None
    coverage: Coverage = field(default_factory=lambda: Coverage())

    def __post_init__(self) -> None:
        for site in (*self.ops, *self.grad_ops):
            self.hooks.setdefault(site, [])

    def grad_records(self) -> Tensor:
        """The backward checks' records since the last drain, (len(grad_ops), 6) float64."""
        if self.grads is None or self.grads.grad is None:
            return self.log.new_zeros(len(self.grad_ops), len(RECORD_FIELDS))
        return self.grads.grad.to(self.log.device)

    def grad_hook(self):
        """What the backward runs at its sites: None unless a hook is attached to one (checked
        when the forward runs, so a hook attached for a step reaches that step's backward), and
        None under torch.compile (backward sites take faults in eager only)."""
        if torch.compiler.is_compiling() or not any(self.hooks.get(s) for s in self.grad_ops):
            return None  # compiled backward graphs do not run Python hooks

        def run(site: str, tensor: Tensor) -> None:
            call = SiteCall(site, tensor, self.name, self.layer, False, self.clock)
            for hook in list(self.hooks[site]):
                out = hook(call)
                if out is not None and out is not tensor and out._base is None:
                    tensor.copy_(out)

        return run

    def kernel_counts(self) -> Tensor | None:
        """The fused kernels' counters so far, forward and backward (int32, on the device)."""
        if self.kernel is None:
            return None
        grad = None if self.kernel_sink is None else self.kernel_sink.grad
        return self.kernel if grad is None else self.kernel + grad.to(torch.int32)

    def reset_kernel_counts(self) -> None:
        if self.kernel is not None:
            self.kernel.zero_()
        if self.kernel_sink is not None:
            self.kernel_sink.grad = None

    def checks(self, op: str) -> bool:
        return op in (self.config.ops if self.checked is None else self.checked)

    def site(self, site: str, tensor: Tensor) -> None:
        """Run the hooks attached to ``site`` on ``tensor`` (no-op when none are attached)."""
        hooks = self.hooks[site]
        if not hooks:
            return
        # .data: edits must not bump autograd's version counter (softmax saves its output)
        call = SiteCall(site, tensor.data, self.name, self.layer, in_replay(), self.clock)
        with torch.no_grad():
            for hook in list(hooks):
                out = hook(call)
                if out is not None and out is not tensor and out._base is None:
                    tensor.data.copy_(out)

    def defer(self, proj: Projection, x: Tensor, y: Tensor, *, last: bool) -> None:
        """Queue the check of projection output y = proj(x); ``last``: the last projection of its
        input (V after Q and K), so the queued projections of each input are checked together."""
        self.pending.append((proj, x, y))
        if last:
            self.flush()

    def flush(self) -> None:
        """Check the queued projections, one call per input tensor (Q, K and V of one input share
        every input-side op), and leave what the core can use (``mode="passing"``)."""
        while self.pending:
            x = self.pending[0][1]
            group = [item for item in self.pending if item[1] is x]
            self.pending = [item for item in self.pending if item[1] is not x]
            self._check_group(x, group)

    def _check_group(self, x: Tensor, group: list[tuple[Projection, Tensor, Tensor]]) -> None:
        flat = x.dim() != 3 or any(y.dim() != 3 for _, _, y in group)
        if flat:  # not (B, L, K) hidden states: checked as (1, T, K) tokens, nothing handed off
            lead = x.shape[:-1]
            if any(y.shape[:-1] != lead or not y.is_contiguous() for _, _, y in group):
                raise UnsupportedModelError(
                    f"{self.name}: a projection of input {tuple(x.shape)} gave outputs "
                    f"{[tuple(y.shape) for _, _, y in group]} that are not its tokens' rows"
                )
            x = x.reshape(1, -1, x.shape[-1])
            group = [(p, x, y.view(1, -1, y.shape[-1])) for p, _, y in group]
        pairs = [(p, y) for p, _, y in group]
        layouts = {(y.shape[-1] // p.groups, p.conv1d) for p, y in pairs}
        if len(layouts) > 1:  # groups of different widths or layouts: one check per projection
            for item in group:
                self._check_group(x, [item])
            return
        factor = row_factor(x, pairs, self.config.tolerance_scale)
        sites = tuple(s for p, _ in pairs for s in p.sites)
        passing = self.config.mode == "passing"
        with _ranged("+".join(sites)):
            rec, ref, bound = projection_check_(
                x,
                pairs,
                max_rows=self.config.max_rows,
                factor=factor,
                floor=row_floor(pairs) / factor,
                bounds=passing,
                impl=self.config.check_impl,
            )
        checked = tuple(s for s in sites if self.checks(s))
        if checked != sites:
            rec = rec[[sites.index(s) for s in checked]]
        if checked:
            self.note(checked, rec)
        if "out" in checked:
            self.commit()  # the last check of the layer
        if passing and not flat:
            self._leave(x, pairs, ref, bound * factor)
        elif passing:
            self.handoff = None  # the core computes V's sums itself

    def _leave(
        self, x: Tensor, pairs: list[tuple[Projection, Tensor]], ref: Tensor, tol: Tensor
    ) -> None:
        """Hand V's clean row sums (columns of ``ref`` (T, sum G)) and how far the delivered V's
        row sums may be from them (``tol``) to the core of this call; a group without V (Q of a
        cross-attention, the output projection) leaves nothing."""
        B, L = x.shape[:2]
        offset = 0
        for p, _ in pairs:
            for site, width in zip(p.sites, p.per_site, strict=True):
                if site == "v" and self.checks("v") and not p.interleaved:  # V's heads contiguous
                    cut = slice(offset, offset + width)
                    self.handoff = Handoff(
                        ref[:, cut].view(B, L, width), tol[:, cut].view(B, L, width)
                    )
                offset += width

    def note(self, ops: tuple[str, ...], rec: Tensor) -> None:
        """Keep the (len(ops), 5) float32 records [rows, cols, value, lost, reproduced] of one
        check until :meth:`commit` writes the layer's records to the log in one go."""
        self.noted.append((ops, rec))

    def commit(self) -> None:
        """Add the noted records to the log. A checkpointing replay repeats a forward already
        counted: its records are counted where they differ from the first pass's (a fault that
        hit the replay alone, or a different one), and dropped where they are the same (what
        the operands imply, such as an overflow upstream, comes back in every replay)."""
        if not self.noted:
            return
        ops = tuple(o for names, _ in self.noted for o in names)
        noted = [r for _, r in self.noted]
        self.noted = []
        if self.log.device != noted[0].device:  # the model moved after protect_
            self.log = self.log.to(noted[0].device)
        first, replay = None, in_replay()  # eager only (compiled code does not replay Python)
        if replay:
            first = self.first_pass.get(ops)
            if first is not None and first.shape[0] != sum(r.shape[0] for r in noted):
                first = None
        step = self.clock.count
        recs, rows = regions.run(
            _records_region, self.config.check_impl, noted, step, first, on=step
        )
        if not replay and not torch.compiler.is_compiling():
            self.first_pass[ops] = recs  # (a traced dict write would be a side effect)
        self.log.index_add_(0, _index(ops, recs.device), rows)


def _records_region(
    noted: list[Tensor], step: Tensor, first: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The (n, 5) records of a layer's checks, in order, and their log rows (n, 7)
    (:data:`RECORD_FIELDS`, zero where a check did not detect: a NaN value of an undetected
    check must not leak); ``first``: the first pass's records of a replay, whose equal
    records are dropped."""
    recs = torch.cat(noted) if len(noted) > 1 else noted[0]
    det = detected(recs)  # (n, 1)
    if first is not None:
        same = ((recs == first) | (recs.isnan() & first.isnan())).all(1, keepdim=True)
        det = det & ~same
    return recs, log_rows(recs, det, step)


def _ranged(label: str):
    """A profiler range per check in eager (benchmarks read them); nothing under compile."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"attnchecker.{label}")


_INDEX: dict[tuple[tuple[str, ...], torch.device], Tensor] = {}


def _index(ops: tuple[str, ...], device: torch.device) -> Tensor:
    key = (ops, device)
    if key in _INDEX:
        return _INDEX[key]
    index = torch.tensor([_ROW[o] for o in ops], device=device)
    if not torch.compiler.is_compiling():
        _INDEX[key] = index
    return index


_ROW = {**{o: i for i, o in enumerate(OPS)}, "y": 0}  # a log row per op; a linear layer's one


def new_log(device: torch.device, n_ops: int = len(OPS)) -> Tensor:
    return torch.zeros(n_ops, len(RECORD_FIELDS), dtype=torch.float64, device=device)
