"""Llama-style decoders (llama, mistral, qwen2, qwen3, olmo2, gemma2): ``q_proj``/``k_proj``/
``v_proj``/``o_proj``,
rotary embeddings applied to Q and K after their projections, grouped K/V heads repeated
``num_key_value_groups`` times, softmax in fp32 cast back to the query dtype. Mistral's sliding
window and Qwen2's projection biases change only the mask and the projections, which the
common path already handles; Qwen3's and OLMo 2's q_norm / k_norm sit between the projections
and the scores like RoPE (below); Gemma 2 passes its ``query_pre_attn_scalar`` scaling and its
logit soft-capping to the attention function, which the core implements exactly.
Dispatches through ``AttentionInterface``.

RoPE (and q_norm / k_norm) sit between the projections and the scores GEMM, so the projections
are checked against their input X and the scores check takes the rotated, normalised Q and K as
its operands; no bound is passed across them.
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


def _is_llama_attention(m: nn.Module) -> bool:
    return all(
        hasattr(m, a)
        for a in ("q_proj", "k_proj", "v_proj", "o_proj", "num_key_value_groups", "head_dim")
    )


@register
class LlamaAdapter(Adapter):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2")

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        spec = CoreSpec(softmax_fp32=True)
        out = []
        for i, (name, m) in enumerate(named(model, _is_llama_attention)):
            layer = layer_index(m, i)
            nh = m.q_proj.out_features // m.head_dim
            nkv = m.k_proj.out_features // m.head_dim
            # q_norm / k_norm (Qwen3, OLMo 2) read Q and K as soon as they are projected: they
            # are checked at once, not with V (which shares their input but comes later)
            wait = not (hasattr(m, "q_norm") or hasattr(m, "k_norm"))
            projections = (
                ProjectionSpec(("q",), m.q_proj, nh, last=not wait),
                ProjectionSpec(("k",), m.k_proj, nkv, last=not wait),
                ProjectionSpec(("v",), m.v_proj, nkv),
                ProjectionSpec(("out",), m.o_proj, nh),
            )
            out.append(AttentionBlock(name, layer, m, projections, spec))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        return install_interface(model)


def _is_phi3_attention(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("qkv_proj", "o_proj", "num_key_value_heads", "head_dim"))


@register
class Phi3Adapter(Adapter):
    """Phi-3: the Llama math with one fused ``qkv_proj`` (Q | K | V of nh, nkv, nkv heads, sliced
    by the module), checked as one projection of three sites of unequal widths."""

    family = "phi3"
    model_types = ("phi3",)

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        spec = CoreSpec(softmax_fp32=True)
        out = []
        for i, (name, m) in enumerate(named(model, _is_phi3_attention)):
            layer = layer_index(m, i)
            nh = m.o_proj.in_features // m.head_dim
            nkv = m.num_key_value_heads
            projections = (
                ProjectionSpec(
                    ("q", "k", "v"), m.qkv_proj, nh + 2 * nkv, site_groups=(nh, nkv, nkv)
                ),
                ProjectionSpec(("out",), m.o_proj, nh),
            )
            out.append(AttentionBlock(name, layer, m, projections, spec))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        return install_interface(model)
