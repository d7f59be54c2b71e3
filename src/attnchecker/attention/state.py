"""Per-module state of protected attention: named sites, counters and pending event records.

Everything that changes during a step is a tensor or a Python list of tensors, so recording a
check costs no host synchronisation; :class:`~attnchecker.models.handle.ProtectionHandle`
turns the pending records into events once per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnchecker.attention.config import OPS, ABFTConfig

__all__ = ["RECORD_FIELDS", "AttentionState", "Clock", "SiteCall", "SiteHook", "in_replay"]

RECORD_FIELDS = ("detected", "corrected", "n_rows", "n_cols", "value")
"""The float64 vector one check appends: flags, the counts of flagged rows / columns of its unit
(tokens and features for a projection, query rows and key columns of the first flagged head for
attention) and the delivered value at the first flagged position."""

MAX_PENDING = 100_000


def in_replay() -> bool:
    """True while autograd runs a node: a forward running now is a checkpointing replay."""
    return torch._C._current_autograd_node() is not None


@dataclass
class Clock:
    """The step counter shared by all protected modules of one model (a root forward pre-hook
    advances it, so checkpointing replays of single layers do not)."""

    step: int = 0


@dataclass
class SiteCall:
    """What a site hook receives. Edit ``tensor`` in place (or return a replacement)."""

    site: str
    tensor: Tensor
    module: str
    layer: int
    step: int
    replay: bool


SiteHook = Callable[[SiteCall], "Tensor | None"]


@dataclass
class AttentionState:
    """Attached to each protected attention module (as a plain attribute, not a buffer)."""

    name: str
    layer: int
    config: ABFTConfig
    clock: Clock
    hooks: dict[str, list[SiteHook]] = field(default_factory=lambda: {s: [] for s in OPS})
    pending: deque[tuple[int, str, bool, Tensor]] = field(
        default_factory=lambda: deque(maxlen=MAX_PENDING)
    )
    totals: Tensor | None = None  # (len(OPS), 2) float64: detected, corrected
    cache: dict[str, Any] = field(default_factory=dict)  # weight-derived sums, keyed by site
    passing: dict[str, Any] = field(default_factory=dict)  # clean references for downstream checks

    def checks(self, op: str) -> bool:
        return op in self.config.ops

    def site(self, site: str, tensor: Tensor) -> None:
        """Run the hooks attached to ``site`` on ``tensor`` (no-op when none are attached)."""
        hooks = self.hooks[site]
        if not hooks:
            return
        # .data: edits must not bump autograd's version counter (softmax saves its output)
        call = SiteCall(site, tensor.data, self.name, self.layer, self.clock.step, in_replay())
        with torch.no_grad():
            for hook in list(hooks):
                out = hook(call)
                if out is not None and out is not tensor and out._base is None:
                    tensor.data.copy_(out)

    def record(self, op: str, rec: Tensor) -> None:
        """Append one check's record (float64, :data:`RECORD_FIELDS`) and count it."""
        replay = in_replay()
        self.pending.append((self.clock.step, op, replay, rec))
        if replay:
            return  # a checkpointing replay repeats a forward already counted
        if self.totals is None or self.totals.device != rec.device:
            self.totals = torch.zeros(len(OPS), 2, dtype=torch.float64, device=rec.device)
        self.totals[OPS.index(op)] += rec[:2]
