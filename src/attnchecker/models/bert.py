"""BERT and RoBERTa: separate query/key/value ``nn.Linear``, output ``attention.output.dense``.
Decoder cross-attention (``add_cross_attention``) has the same layout, with K and V projected
from the encoder states: the projection checks group by input, so both halves are checked.

Eager attention: scores * scaling + additive padding mask, softmax, dropout, context, then
``transpose(1, 2).contiguous()``. Dispatches through ``AttentionInterface``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnchecker.attention.core import CoreSpec
from attnchecker.models.interface import install_interface
from attnchecker.models.registry import (
    Adapter,
    AttentionBlock,
    ProjectionSpec,
    layer_index,
    named,
    register,
)

SPEC = CoreSpec()


def _is_self_attention_block(m: nn.Module) -> bool:
    inner = getattr(m, "self", None)
    return all(
        hasattr(inner, a) for a in ("query", "key", "value", "num_attention_heads")
    ) and hasattr(getattr(m, "output", None), "dense")


@register
class BertAdapter(Adapter):
    family = "bert"
    model_types = ("bert", "roberta")

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        out = []
        for i, (name, m) in enumerate(named(model, _is_self_attention_block)):
            sa, nh = m.self, m.self.num_attention_heads
            layer = layer_index(sa, i)
            projections = (
                ProjectionSpec(("q",), sa.query, nh, last=False),
                ProjectionSpec(("k",), sa.key, nh, last=False),
                ProjectionSpec(("v",), sa.value, nh),
                ProjectionSpec(("out",), m.output.dense, nh),
            )
            out.append(AttentionBlock(f"{name}.self", layer, sa, projections, SPEC))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        return install_interface(model)
