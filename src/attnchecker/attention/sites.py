"""Named sites: where a protected module lets a hook see (and edit) a tensor between the GEMM
that produced it and its check. This is how faults are placed, forward and backward; a site
with no hook attached costs one dict lookup."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["SiteCall", "SiteHook", "Sites", "in_replay"]


def in_replay() -> bool:
    """True while autograd runs a node: a forward running now is a checkpointing replay.
    Always False under torch.compile, which does not replay Python code."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_autograd_node() is not None


@dataclass
class SiteCall:
    """What a site hook receives. Edit ``tensor`` in place (or return a replacement)."""

    site: str
    tensor: Tensor
    module: str
    layer: int
    replay: bool
    clock: object = field(repr=False)  # attention.state.Clock

    @property
    def step(self) -> int:
        """Forward passes of the model so far, counting this one (reads the device clock)."""
        return self.clock.step


SiteHook = Callable[[SiteCall], "Tensor | None"]


class Sites:
    """The named sites of one protected module and the hooks attached to each; and
    ``kernel_fault``: a fault the fused kernels' next calls inject (tests, campaigns)."""

    def __init__(self, names: Iterable[str], module: str, layer: int, clock: object) -> None:
        self.hooks: dict[str, list[SiteHook]] = {s: [] for s in names}
        self.module, self.layer, self.clock = module, layer, clock
        self.kernel_fault: object | None = None

    def keep(self, names: Iterable[str]) -> None:
        """Keep only these sites (those the module really has: a fused Q|K|V projection has
        one ``dx`` GEMM, a Linear with a forward of its own none)."""
        names = set(names)
        self.hooks = {s: hooks for s, hooks in self.hooks.items() if s in names}

    def run(self, site: str, tensor: Tensor) -> None:
        """Run the hooks attached to ``site`` on ``tensor`` (no-op when none are attached)."""
        hooks = self.hooks[site]
        if not hooks:
            return
        # .data: edits must not bump autograd's version counter (softmax saves its output)
        data = tensor.data
        call = SiteCall(site, data, self.module, self.layer, in_replay(), self.clock)
        with torch.no_grad():
            for hook in list(hooks):
                _apply(hook(call), data)

    def grad_hook(self, names: Iterable[str]) -> Callable[[str, Tensor], None] | None:
        """What the backward runs at its sites (``names``): None unless a hook is attached to
        one (asked when the forward runs, so a hook attached for a step reaches that step's
        backward), and None under torch.compile (compiled backward graphs run no Python)."""
        if torch.compiler.is_compiling() or not any(self.hooks.get(s) for s in names):
            return None

        def run(site: str, tensor: Tensor) -> None:
            call = SiteCall(site, tensor, self.module, self.layer, False, self.clock)
            for hook in list(self.hooks[site]):
                _apply(hook(call), tensor)

        return run


def _apply(out: Tensor | None, tensor: Tensor) -> None:
    """A hook that returned a new tensor (not a view of its input) replaces the values."""
    if out is not None and out is not tensor and out._base is None:
        tensor.copy_(out)
