"""The schedule: which op is checked in which protected module on which step.

One :class:`Schedule` per protected model, shared by all its modules and asked by every engine
(the projection hooks, the checked linear layers' backward, the eager core, the fused kernels'
switches) through :meth:`~attnchecker.attention.state.AttentionState.checks`. It is advanced at
one place, :meth:`~attnchecker.models.handle.ProtectionHandle.drain`, so a period of k checks
the drains' steps 1, 1 + k, 1 + 2k, ... whatever number of forwards (evaluation, gradient
accumulation, checkpointing replays) happens between two drains.

What a compiled model reads is one Python bool (:attr:`Schedule.on`) and, per module, one of
two frozensets fixed at ``protect_``: it guards on them, so a periodic schedule holds two graphs
(the checked and the unchecked step) and never recompiles.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Schedule"]


class Schedule:
    """``ops`` in every layer of ``layers`` (None: all), or, with ``entries``, per-layer
    ``(layer, op, every)`` triples: ``every`` = 1 for every step, k for every k-th step (one k
    per schedule); :meth:`layer_ops` reads either the same way."""

    def __init__(
        self,
        ops: Iterable[str],
        layers: Iterable[int] | None = None,
        entries: Iterable[tuple[int, str, int]] | None = None,
    ) -> None:
        self.ops = frozenset(ops)
        self.layers = None if layers is None else frozenset(layers)
        self.entries = None if entries is None else tuple(entries)
        self.period = max((every for _, _, every in self.entries or ()), default=1)
        self.drains = 0
        self.on = True  # whether the step now running is a checked one (step 1 is)
        self._modules: dict[str, tuple[frozenset[str], frozenset[str]]] = {}

    @classmethod
    def of(cls, config) -> Schedule:
        """The schedule an :class:`~attnchecker.attention.config.ABFTConfig` describes."""
        return cls(config.ops, config.layers, config.schedule)

    def layer_ops(self, layer: int, step: int | None = None) -> frozenset[str]:
        """The ops checked in ``layer`` (at ``step``, counting from 1, when given: a periodic
        check runs on steps 1, 1 + k, 1 + 2k, ...; without a step, those of a checked step)."""
        if self.entries is None:
            chosen = self.layers is None or layer in self.layers
            return self.ops if chosen else frozenset()
        return frozenset(
            op
            for at, op, every in self.entries
            if at == layer and (every == 1 or step is None or (step - 1) % every == 0)
        )

    def linear_ops(self, layer: int, role: str, step: int | None = None) -> frozenset[str]:
        """The checks of the linear layer ``role`` of ``layer`` that the entries name
        (``mlp.c_fc:y`` -> ``y``), as :meth:`layer_ops` reads them."""
        mine = role + ":"
        ops = self.layer_ops(layer, step) if self.entries is not None else frozenset()
        return frozenset(o[len(mine) :] for o in ops if o.startswith(mine))

    # -- the modules of one protected model, and the step it is at

    def bind(
        self, module: str, layer: int, ops: Iterable[str] | None = None, role: str | None = None
    ) -> None:
        """Register a protected module: it checks its ``layer``'s ops on each step; a linear
        layer outside attention (its ``role`` in the block, ``mlp.c_fc``) the entries that name
        it (``mlp.c_fc:y``) or, without entries, the fixed ``ops`` on every step."""
        if role is not None and self.entries is not None:
            off, on = (self.linear_ops(layer, role, step) for step in (2, None))
            self._modules[module] = (off, on)
        elif ops is not None:
            fixed = frozenset(ops)
            self._modules[module] = (fixed, fixed)
        else:
            self._modules[module] = (self.layer_ops(layer, step=2), self.layer_ops(layer))

    def ops_of(self, module: str, *, on: bool | None = None) -> frozenset[str]:
        """The ops ``module`` checks now (``on``: on an unchecked / a checked step)."""
        return self._modules[module][self.on if on is None else on]

    def checks(self, module: str, op: str) -> bool:
        return op in self._modules[module][self.on]

    def advance(self) -> None:
        """One training step done (a drain): the next one, the (drains + 1)-th, is a checked
        step when drains is a multiple of the period."""
        self.go_to(self.drains + 1)

    def go_to(self, drains: int) -> None:
        """Stand after ``drains`` drains (:meth:`advance`; a replayed step goes back one)."""
        self.drains = drains
        self.on = self.drains % self.period == 0
