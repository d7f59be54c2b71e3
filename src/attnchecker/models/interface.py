"""The checked attention function, registered with transformers' ``AttentionInterface``.

It is total over what transformers calls: a module bound by protection runs the checked core; any
other module that reaches it (a module discovery did not bind, a layer not selected)
runs its own family's eager attention, exactly. Every keyword is either known not to change the
eager math (:data:`KEYWORDS`) or refused with :class:`~attnchecker.errors.UnsupportedModelError`
naming it: never silently different math.

A custom implementation name needs a mask function registered under the same name too, or the
model silently receives no mask (GPT-2 would stop being causal, padding would be ignored); the
eager mask is the one the core's eager math expects (sliding windows included).

When no protected module needs the checked core (no core op asked, no hook at a core site:
:meth:`~attnchecker.attention.state.AttentionState.needs_core`), the model's own attention
runs instead, untouched: its implementation's mask (transformers passes the config to the mask
function, which finds the model's :class:`Own` by it) and its attention function, after the
queued projection checks (:class:`Own`, decided once per forward by one predicate for the mask
and for every layer).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from functools import partial

from torch import Tensor, nn

from attnchecker.attention.core import CORE, attend
from attnchecker.attention.engines import (
    EAGER,
    FLASH,
    SDPA,
    CoreCall,
    Engine,
    before_core,
    run_core,
)
from attnchecker.attention.masks import eager_from_keys, masked_out
from attnchecker.attention.state import AttentionState
from attnchecker.errors import UnsupportedModelError

__all__ = [
    "KEYWORDS", "NAME", "OWN", "SDPA_NAME", "TRITON_NAME", "Own", "attend_bound",
    "install_interface",
]  # fmt: skip

NAME = "attnchecker"
TRITON_NAME = "attnchecker_triton"  # backend="triton" (the fused kernels): the 2D mask
SDPA_NAME = "attnchecker_route"  # backend="sdpa": transformers' SDPA mask (no "sdpa" in the name:
# transformers reads a name holding it as its own SDPA and asks the model to support that)

_NAMES = {EAGER: NAME, FLASH: TRITON_NAME, SDPA: SDPA_NAME}  # the function of each engine

KEYWORDS: dict[str, str] = {
    # keyword: why the checked core may take it as the family's eager attention does
    "sliding_window": "the eager mask already holds the window (Mistral, Qwen2)",
    "is_causal": "used by SDPA and flash kernels; the eager math takes causality from the mask",
    "position_ids": "consumed before attention (rotary embeddings, flash varlen)",
    "cache_position": "consumed by the cache and the mask",
    "output_attentions": "the probabilities are always returned",
    "use_cache": "consumed by the cache",
    "past_key_values": "consumed by the cache",
    "cu_seq_lens_q": "flash varlen only; eager ignores it",
    "cu_seq_lens_k": "flash varlen only; eager ignores it",
    "max_length_q": "flash varlen only; eager ignores it",
    "max_length_k": "flash varlen only; eager ignores it",
    "output_hidden_states": "model-level output option",
    "output_router_logits": "model-level output option",
    "num_items_in_batch": "consumed by the loss",
    "seq_idx": "packed-sequence index for flash/mamba kernels; eager ignores it",
    "return_dict": "model-level output option",
    "encoder_hidden_states": "consumed by the projections",
    "encoder_attention_mask": "consumed by the mask",
    "softcap": "logit soft-capping (Gemma 2), implemented by the core as the eager math does it",
}
"""Keywords the checked core accepts. Anything else that is not None is refused by name:
attention sinks (``s_aux``), and whatever transformers adds later."""


OWN = "_attnchecker_own"
"""Attribute of every attention core module of a model routed through :data:`NAME`: its
:class:`Own`."""


class Own:
    """The model's own attention implementation ``impl`` (before protect_: "sdpa", "eager",
    ...), and whether it runs instead of the checked core (:meth:`runs`) over ``states``, every
    protected module of the model."""

    def __init__(self, impl: str, states: Sequence[AttentionState]) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        self.impl, self.states = impl, tuple(states)
        # an implementation transformers has both functions for (eager: the family's own)
        self.known = impl == "eager" or (
            impl in AttentionInterface._global_mapping
            and impl in AttentionMaskInterface._global_mapping
        )

    def runs(self) -> bool:
        """No protected module needs the checked core: the model's own mask and attention (per
        call: a hook attached at a core site brings the core back at the next forward)."""
        return self.known and not any(st.needs_core() for st in self.states)


_OWNS: dict[int, Own] = {}  # id(model.config) -> its Own, while protected


def _mask(
    *args: object, config: object = None, sdpa: bool = False, **kwargs: object
) -> Tensor | None:
    """The mask function of :data:`NAME` (``sdpa``: of :data:`SDPA_NAME`): the model's own
    implementation's while its own attention runs (:meth:`Own.runs`), else the mask the checked
    core takes (the eager one; the SDPA route's: transformers' SDPA mask)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

    own = _OWNS.get(id(config))
    fn = sdpa_mask if sdpa else eager_mask
    if own is not None and own.runs():
        fn = ALL_MASK_ATTENTION_FUNCTIONS[own.impl]
    return fn(*args, config=config, **kwargs)


def _own_attention(
    impl: str, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, scaling: float | None, dropout: float, **kwargs: object,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The model's own attention function ``impl`` on its own mask: exactly what it ran before
    protection (``"eager"``: the family's ``eager_attention_forward``, GPT-2's upcast variant)."""
    if impl != "eager":
        from transformers import AttentionInterface

        fn = AttentionInterface._global_mapping[impl]
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                  **kwargs)  # fmt: skip
    if getattr(module, "reorder_and_upcast_attn", False):
        return module._upcast_and_reordered_attn(query, key, value, attention_mask)
    return _eager_of(module)(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
    )


def _refuse(kwargs: dict[str, object]) -> None:
    for name, value in kwargs.items():
        if value is None:
            continue
        if name not in KEYWORDS:
            raise UnsupportedModelError(
                f"the checked attention does not implement {name}={value!r}; protect_ would "
                f"compute different math than the model's eager attention, so it refuses"
            )


def _eager_of(module: nn.Module) -> Callable[..., tuple[Tensor, Tensor]]:
    """The module's own family eager attention (transformers' ``eager_attention_forward``)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} reached the checked attention without protection and "
            f"its module has no eager_attention_forward to fall back on"
        )
    return fn


def attend_bound(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *,
    scaling: float | None, dropout: float, **options: object,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The checked eager core that protection bound to ``module`` (its spec and state), in the
    module's training mode; ``options``: :class:`~attnchecker.attention.engines.CoreCall`'s
    others. A module bound without a state runs the family's eager math, unchecked."""
    spec, state = getattr(module, CORE)
    s = query.size(-1) ** -0.5 if scaling is None else scaling
    if state is None:
        neo = options.pop("neo_causal", None)
        return attend(spec, query, key, value, mask, scaling=s, dropout=dropout,
                      training=module.training, causal=neo, **options)  # fmt: skip
    call = CoreCall(spec, query, key, value, mask, lambda: mask, s, dropout, module.training,
                    **options)  # fmt: skip
    return run_core(EAGER, state, call)


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    engine: Engine = EAGER,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """The function registered as :data:`NAME` (the eager engine), :data:`TRITON_NAME` (the
    fused kernels: ``attention_mask`` is the 2D key padding mask or None, causality and the
    sliding window come from the module and the keywords, as for flash attention) and
    :data:`SDPA_NAME` (the SDPA route: transformers' SDPA mask, 4-D bool or None, causality as
    its SDPA attention decides it)."""
    bound = getattr(module, CORE, None)
    state = None if bound is None else bound[1]
    own = None if engine is FLASH else getattr(module, OWN, None)
    if own is not None and own.runs():  # nothing needs the core: the model's own attention
        if state is not None:
            before_core(state)  # the projections it reads are checked first
        return _own_attention(own.impl, module, query, key, value, attention_mask, scaling,
                              dropout, **kwargs)  # fmt: skip
    _refuse(kwargs)
    upcast = bool(getattr(module, "reorder_and_upcast_attn", False))  # GPT-2's option
    options = {"softcap": kwargs.get("softcap"), "upcast_reordered": upcast}
    if state is None and engine is SDPA:  # not protected: transformers' SDPA on its own mask
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)  # fmt: skip
    if state is None and engine is FLASH:  # not protected: the eager math on the eager mask
        attention_mask = _fused_call(module, query, key, attention_mask, kwargs)[1]()
    if bound is None:  # not protected: exactly what "eager" would have run
        if upcast:
            return module._upcast_and_reordered_attn(query, key, value, attention_mask)
        return _eager_of(module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if state is None or engine is EAGER:
        return attend_bound(module, query, key, value, attention_mask, scaling=scaling,
                            dropout=dropout, **options)  # fmt: skip
    s = query.size(-1) ** -0.5 if scaling is None else scaling  # the checked core's scaling
    if engine is SDPA:
        causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True)) if causal is None else bool(causal)
        causal = query.shape[2] > 1 and attention_mask is None and causal  # as transformers'
        eager = partial(_route_eager_mask, attention_mask, query, key, causal)
        window = 0
    else:
        (causal, window), eager = _fused_call(module, query, key, attention_mask, kwargs)
    call = CoreCall(bound[0], query, key, value, attention_mask, eager, s, dropout,
                    module.training, causal=causal, window=window, prefill=engine is SDPA,
                    **options)  # fmt: skip
    return run_core(engine, state, call)


def _route_eager_mask(mask: Tensor | None, query: Tensor, key: Tensor, causal: bool):
    """The SDPA route's mask (transformers' SDPA mask: 4-D bool or None, then ``causal``) as the
    eager core takes it."""
    if mask is not None:
        return masked_out(~mask, query.dtype)
    return eager_from_keys(None, query.shape[-2], key.shape[-2], causal=causal, window=0,
                           dtype=query.dtype, device=query.device)  # fmt: skip


def _fused_call(module, query, key, key_mask, kwargs):
    """((causal, window), the eager mask builder) of a call through :data:`TRITON_NAME`."""
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", False)) if causal is None else bool(causal)
    window = int(kwargs.get("sliding_window") or 0)
    L, Lk = query.shape[-2], key.shape[-2]
    eager = partial(eager_from_keys, key_mask, L, Lk, causal=causal, window=window,
                    dtype=query.dtype, device=query.device)  # fmt: skip
    return (causal, window), eager


def _fused_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    *args: object,
    attention_mask: Tensor | None = None,
    **kwargs: object,
) -> Tensor | None:
    """The fused backend's mask: the 2D key padding mask over the last ``kv_length`` keys, as
    transformers' flash-attention mask, but never tested for being all ones (``.all()`` would
    synchronise and break a compiled graph); causality and the window come from the module."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def install_interface(
    model: nn.Module,
    *,
    engine: Engine = EAGER,
    cores: Sequence[nn.Module] = (),
    states: Sequence[AttentionState] = (),
) -> Callable[[], None]:
    """Register the core (idempotent) and switch ``model`` to ``engine``'s function; return the
    undo. The fused kernels take transformers' flash-attention mask (2D padding or None), the
    SDPA route its SDPA mask. ``cores`` (the attention modules) get the model's :class:`Own`
    over ``states``: its own attention runs while none of them needs the checked core."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for eng, name in _NAMES.items():
        AttentionInterface.register(name, partial(_attention, engine=eng))
    AttentionMaskInterface.register(NAME, _mask)
    AttentionMaskInterface.register(TRITON_NAME, _fused_mask)
    AttentionMaskInterface.register(SDPA_NAME, partial(_mask, sdpa=True))
    previous = model.config._attn_implementation
    model.set_attn_implementation(_NAMES[engine])
    own = Own(previous or "eager", states)
    _OWNS[id(model.config)] = own
    for core in cores:
        setattr(core, OWN, own)

    def undo() -> None:
        model.set_attn_implementation(previous)
        _OWNS.pop(id(model.config), None)
        for core in cores:
            if getattr(core, OWN, None) is own:
                delattr(core, OWN)

    return undo
