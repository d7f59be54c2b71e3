"""GPT-Neo's attention, which does not dispatch through ``AttentionInterface``: its module's
``_attn`` method is replaced on the instance (and deleted again on unprotect) by the checked
core. Eager GPT-Neo has no 1/sqrt(d) scaling, upcasts q and k to fp32, masks with its own causal
(global layers) or windowed causal (local layers) ``bias`` buffer before adding the attention
mask, and casts the probabilities back to V's dtype (its table entry's spec).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnchecker.attention.core import CORE
from attnchecker.attention.engines import before_core
from attnchecker.models.interface import attend_bound

__all__ = ["gpt_neo_attn"]


def gpt_neo_attn(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    """The checked ``_attn`` of one GPT-Neo attention module."""

    def _attn(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None):
        state = getattr(module, CORE)[1]
        if state is not None and not state.needs_core():  # its own _attn, untouched
            before_core(state)  # the projections it reads are checked first
            return type(module)._attn(module, query, key, value, attention_mask)
        L, Lk = query.shape[-2], key.shape[-2]
        return attend_bound(
            module, query, key, value, attention_mask, scaling=None,
            dropout=module.attn_dropout.p, neo_causal=module.bias[:, :, Lk - L : Lk, :Lk],
        )  # fmt: skip

    return _attn
