"""The checked attention core, registered with transformers' ``AttentionInterface``.

A custom implementation name needs a mask function registered under the same name too, or the
model silently receives no mask (GPT-2 would stop being causal, padding would be ignored); the
eager mask is the one the core's eager math expects.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnchecker.attention.core import attend
from attnchecker.models.registry import CORE

__all__ = ["NAME", "install_interface"]

NAME = "attnchecker"


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[Tensor, Tensor]:
    spec, state = getattr(module, CORE)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    upcast = bool(getattr(module, "reorder_and_upcast_attn", False))  # GPT-2's option
    return attend(
        module,
        spec,
        query,
        key,
        value,
        attention_mask,
        scaling=scaling,
        dropout=dropout,
        state=state,
        upcast_reordered=upcast,
    )


def install_interface(model: nn.Module) -> Callable[[], None]:
    """Register the core (idempotent) and switch ``model`` to it; return the undo."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, eager_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    return lambda: model.set_attn_implementation(previous)
