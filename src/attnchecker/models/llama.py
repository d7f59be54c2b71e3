"""Llama-style decoders (llama, mistral, qwen2): ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
rotary embeddings applied to Q and K after their projections, grouped K/V heads repeated
``num_key_value_groups`` times, softmax in fp32 cast back to the query dtype. Mistral's sliding
window and Qwen2's projection biases change only the mask and the projections, which the
common path already handles. Dispatches through ``AttentionInterface``.

RoPE sits between the projections and the scores GEMM, so the projections are checked against
their input X and the scores check takes the rotated Q and K as its operands.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from attnchecker.attention.core import CoreSpec
from attnchecker.models.interface import install_interface
from attnchecker.models.registry import Adapter, AttentionBlock, ProjectionSpec, named, register


def _is_llama_attention(m: nn.Module) -> bool:
    return all(
        hasattr(m, a)
        for a in ("q_proj", "k_proj", "v_proj", "o_proj", "num_key_value_groups", "head_dim")
    )


@register
class LlamaAdapter(Adapter):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2")

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        spec = CoreSpec(softmax_fp32=True)
        out = []
        for i, (name, m) in enumerate(named(model, _is_llama_attention)):
            layer = m.layer_idx if isinstance(getattr(m, "layer_idx", None), int) else i
            nh = m.q_proj.out_features // m.head_dim
            nkv = m.k_proj.out_features // m.head_dim
            projections = (
                ProjectionSpec(("q",), m.q_proj, nh, last=False),
                ProjectionSpec(("k",), m.k_proj, nkv, last=False),
                ProjectionSpec(("v",), m.v_proj, nkv),
                ProjectionSpec(("out",), m.o_proj, nh),
            )
            out.append(AttentionBlock(name, layer, m, projections, spec))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        return install_interface(model)
