"""Family adapters, keyed by ``config.model_type``, and the machinery they share.

An adapter finds the attention modules of a model and says, for each, which submodules compute
the Q, K, V and output projections and how the family's eager attention differs
(:class:`~attnchecker.attention.core.CoreSpec`). It then installs the checked attention core:
through transformers' ``AttentionInterface`` for families that dispatch through it, or by
patching the module for those that do not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from attnchecker.attention.core import CoreSpec
from attnchecker.errors import UnsupportedModelError

__all__ = [
    "CORE",
    "REGISTRY",
    "Adapter",
    "AttentionBlock",
    "ProjectionSpec",
    "adapter_for",
    "layer_index",
    "register",
]

CORE = "_attnchecker_core"
"""Attribute that carries (CoreSpec, AttentionState | None) on every attention core module."""


@dataclass(frozen=True)
class ProjectionSpec:
    """A projection submodule: its sites (three for a fused Q|K|V), output groups (heads)."""

    sites: tuple[str, ...]
    module: nn.Module
    groups: int
    conv1d: bool = False  # GPT-2's Conv1D: weight stored (in, out), y = addmm(b, x, W)
    last: bool = True  # the last projection of its input (V after Q and K): check them now
    site_groups: tuple[int, ...] = ()  # groups of each site when not equal (fused Q|K|V + GQA)


@dataclass(frozen=True)
class AttentionBlock:
    """One attention layer as protection sees it."""

    name: str  # qualified name of the module that owns the attention core
    layer: int
    core: nn.Module
    projections: tuple[ProjectionSpec, ...]
    spec: CoreSpec


class Adapter:
    """Base of the family adapters."""

    family: str = ""
    model_types: tuple[str, ...] = ()

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        raise NotImplementedError

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        """Route every block's attention through the checked core; return the undo."""
        raise NotImplementedError


REGISTRY: dict[str, Adapter] = {}


def register(adapter: type[Adapter]) -> type[Adapter]:
    instance = adapter()
    for model_type in adapter.model_types:
        REGISTRY[model_type] = instance
    return adapter


def _load_adapters() -> None:
    from attnchecker.models import bert, gpt2, gpt_neo, llama  # noqa: F401  (they register)


def adapter_for(model: nn.Module) -> Adapter:
    _load_adapters()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in REGISTRY:
        supported = ", ".join(sorted(REGISTRY))
        raise UnsupportedModelError(
            f"no attnchecker adapter for model_type {model_type!r}; supported: {supported}"
        )
    return REGISTRY[model_type]


def layer_index(module: nn.Module, position: int) -> int:
    """The module's own ``layer_idx`` when it has one, else its position among the model's
    attention modules."""
    idx = getattr(module, "layer_idx", None)
    return idx if isinstance(idx, int) else position


def named(model: nn.Module, predicate: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if predicate(m)]
