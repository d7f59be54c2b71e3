"""GPT-2: a fused ``Conv1D`` ``c_attn`` (weight stored (in, out)) yields Q|K|V; ``attn.c_proj``
is the output projection. Cross-attention (``add_cross_attention``) takes Q from ``q_attn`` on
the decoder states and K|V from ``c_attn`` on the encoder states. Causal mask from the mask
interface; scaling by 1/sqrt(d) and optionally by 1/(layer + 1), both folded into
``module.scaling``; ``reorder_and_upcast_attn`` computes fp32 scores with the scaling inside
the GEMM. Probabilities are cast to V's dtype.
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

SPEC = CoreSpec(probs_to_value_dtype=True, contiguous_out=False)


def _is_gpt2_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("c_attn", "c_proj", "split_size", "num_heads"))


@register
class GPT2Adapter(Adapter):
    family = "gpt2"
    model_types = ("gpt2",)

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        out = []
        for i, (name, m) in enumerate(named(model, _is_gpt2_attention)):
            layer = layer_index(m, i)
            nh = m.num_heads
            if getattr(m, "is_cross_attention", False):  # Q from the decoder, K|V from the encoder
                qkv = (
                    ProjectionSpec(("q",), m.q_attn, nh, conv1d=True, last=False),
                    ProjectionSpec(("k", "v"), m.c_attn, 2 * nh, conv1d=True),
                )
            else:
                qkv = (ProjectionSpec(("q", "k", "v"), m.c_attn, 3 * nh, conv1d=True),)
            projections = (*qkv, ProjectionSpec(("out",), m.c_proj, nh, conv1d=True))
            out.append(AttentionBlock(name, layer, m, projections, SPEC))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        return install_interface(model)
