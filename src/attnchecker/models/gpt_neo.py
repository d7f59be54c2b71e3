"""GPT-Neo: ``q_proj``/``k_proj``/``v_proj`` without bias, ``out_proj`` with bias. Eager attention
has no 1/sqrt(d) scaling, upcasts q and k to fp32, masks with its own causal (global layers) or
windowed causal (local layers) ``bias`` buffer before adding the attention mask, and casts the
probabilities back to V's dtype. It does not dispatch through ``AttentionInterface``: the
module's ``_attn`` method is replaced on the instance (and deleted again on unprotect).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from attnchecker.attention.core import CoreSpec, attend
from attnchecker.models.registry import (
    CORE,
    Adapter,
    AttentionBlock,
    ProjectionSpec,
    named,
    register,
)

SPEC = CoreSpec(upcast_qk=True, scale=False, probs_to_value_dtype=True, transpose_out=False)


def _is_gpt_neo_attention(m: nn.Module) -> bool:
    return all(
        hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj", "out_proj", "_attn", "attention_type")
    )


def _checked_attn(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    def _attn(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None):
        spec, state = getattr(module, CORE)
        L, Lk = query.shape[-2], key.shape[-2]
        return attend(
            spec,
            query,
            key,
            value,
            attention_mask,
            scaling=None,
            dropout=module.attn_dropout.p,
            training=module.training,
            state=state,
            causal=module.bias[:, :, Lk - L : Lk, :Lk],
        )

    return _attn


@register
class GPTNeoAdapter(Adapter):
    family = "gpt_neo"
    model_types = ("gpt_neo",)

    def blocks(self, model: nn.Module) -> list[AttentionBlock]:
        out = []
        for i, (name, m) in enumerate(named(model, _is_gpt_neo_attention)):
            layer = m.layer_id if isinstance(getattr(m, "layer_id", None), int) else i
            nh = m.num_heads
            projections = (
                ProjectionSpec(("q",), m.q_proj, nh, last=False),
                ProjectionSpec(("k",), m.k_proj, nh, last=False),
                ProjectionSpec(("v",), m.v_proj, nh),
                ProjectionSpec(("out",), m.out_proj, nh),
            )
            out.append(AttentionBlock(name, layer, m, projections, SPEC))
        return out

    def install(self, model: nn.Module, blocks: list[AttentionBlock]) -> Callable[[], None]:
        for b in blocks:
            b.core._attn = _checked_attn(b.core)

        def undo() -> None:
            for b in blocks:
                del b.core._attn

        return undo
