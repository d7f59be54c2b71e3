"""Counting the aten ops a piece of work dispatches (like ``torch.testing``: a helper for tests
and benchmarks, not part of the protection).

On a GPU every dispatched op that computes something is a kernel launch of a few microseconds,
so for small per-layer work the count, not the FLOPs, sets the cost. Views and other metadata
ops (:data:`VIEW_OPS`) launch nothing; :class:`OpCounter` reports both the total a dispatch
mode sees and the launching part.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SYNCING_OPS", "VIEW_OPS", "OpCounter", "count_ops"]

VIEW_OPS = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.unsqueeze",
        "aten.squeeze", "aten.squeeze_", "aten.slice", "aten.select", "aten.expand",
        "aten.alias", "aten.detach", "aten.as_strided", "aten.permute", "aten.split",
        "aten.split_with_sizes", "aten.unbind", "aten.narrow", "aten.lift_fresh",
        "aten._reshape_alias", "aten.view_as", "aten.diagonal",
        "profiler._record_function_enter_new", "profiler._record_function_exit",
    }
)  # fmt: skip
"""Ops that only make a new view of existing memory (or mark a profiler range)."""


SYNCING_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), bool(tensor), int(tensor)
        "aten.nonzero",  # data-dependent shapes synchronise on accelerators
        "aten.masked_select",
        "aten.is_nonzero",
    }
)
"""Ops that make the host wait for the device."""


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by ``aten.<name>`` (overloads merged)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> dict[str, int]:
        """How often each host-synchronising op (:data:`SYNCING_OPS`) ran."""
        return {op: n for op, n in self.ops.items() if op in SYNCING_OPS}

    @property
    def launching(self) -> int:
        """Ops that compute something (a kernel launch on an accelerator)."""
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Run ``fn`` once under an :class:`OpCounter` and return the counter."""
    with OpCounter() as counter:
        fn()
    return counter
