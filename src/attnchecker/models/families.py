"""The family table: one entry per supported ``model_type``, the only list of families.

An entry says where the family's attention is and how its eager attention differs
(:class:`Wiring`), and how its tiny / small / base configs are built and trained
(:class:`Family`). Discovery (:mod:`attnchecker.models.registry`), the tiny configs
(:mod:`attnchecker.models.tiny`), the CLI's choices, the campaigns, the SDC boundaries, the
benchmarks and the generated contract tests all read it. A model whose ``model_type`` is not
here goes through the generic rule of the registry (a wiring of this table that fits, and an
eager attention the core reproduces bitwise on a probe), or is refused by name.

Adding a family that dispatches through ``AttentionInterface`` is one entry: its config class,
its config keys when they are not the common ones, and a :class:`Wiring` when its projections
are not named ``q_proj``/``k_proj``/``v_proj``/``o_proj``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from attnchecker.attention.core import CoreSpec
from attnchecker.models.gpt_neo import gpt_neo_attn

__all__ = ["FAMILIES", "TABLE", "Family", "Wiring"]


_LLAMA = CoreSpec(softmax_fp32=True)  # softmax in fp32, back to the query dtype


@dataclass(frozen=True)
class Wiring:
    """Where one family's attention is, relative to each attention module discovery finds.

    ``projections`` are ``"path:sites"``: a submodule path relative to the module and the sites
    its output holds, in order (``q``, ``k``, ``v``, ``kv``, ``qkv`` for a fused Q|K|V, or
    ``out``); a module is an attention module of the family when every path resolves to a
    module with a weight. ``cross`` replaces them on modules with ``is_cross_attention`` set
    (GPT-2's Q from ``q_attn``, K|V from ``c_attn``).
    """

    projections: tuple[str, ...] = ("q_proj:q", "k_proj:k", "v_proj:v", "o_proj:out")
    cross: tuple[str, ...] = ()
    core: str = ""  # the submodule that calls the attention function ("" = the module itself)
    spec: CoreSpec = _LLAMA  # what its eager attention does
    # a fused Q|K|V laid out per K/V group, [q heads of g | k_g | v_g]; per head (one query
    # head a group), [q_h | k_h | v_h], in GPT-NeoX
    interleaved: bool = False
    # sites the module reads before V is projected (q_norm / k_norm, OPT's q * scaling): they
    # are checked as soon as they are projected; the others wait for V, the checks of one input
    # sharing one pass over it
    read_early: tuple[str, ...] = ()
    # V reaches the core as the projection delivered it (views, a cache): the V projection
    # check's row sums may serve the context check (mode="passing")
    passing: bool = True
    # (method, factory): the core's method replaced on the instance by factory(core), for a
    # family that does not dispatch through AttentionInterface (GPT-Neo's _attn)
    patch: tuple[str, Callable[[Any], Callable[..., Any]]] | None = None
    # the core is reached at F.scaled_dot_product_attention calls (models.sdpa: a patch of the
    # caller's forward), where the fused kernels can run it as through the interface
    sdpa: bool = False


_COMMON_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class Family:
    """One supported family: its wiring, how the tiny / small / base configs build it (its
    transformers config class, the config keys of (hidden, layers, heads, positions), what else
    a size implies), how it is trained and run by default, and its blocks' sublayers."""

    config: str  # transformers config class
    wiring: Wiring = Wiring()
    keys: tuple[str, str, str, str] = _COMMON_KEYS
    extra: Callable[[int, int, int, int], dict[str, Any]] = lambda h, nl, n, L: {}
    head: str = "causal"  # "causal" LM, "masked" LM or "seq2seq" LM
    sdpa: bool = True  # transformers has an SDPA path for it (the users' default)
    ids: dict[str, int] = field(default_factory=dict)  # special tokens inside the tiny vocab
    positions_extra: int = 0  # BERT-style position tables hold max_len + 2
    # (attention, MLP): the children of a transformer block that are its attention and its MLP
    # (models.registry.transformer_blocks; the boundaries the SDC analysis compares)
    sublayers: tuple[str, str] = ("self_attn", "mlp")

    @property
    def generates(self) -> bool:
        """It has a ``generate()`` (a causal or a sequence-to-sequence LM)."""
        return self.head != "masked"


def _rotary(h: int, nl: int, n: int, L: int) -> dict[str, Any]:
    """Llama-style decoders: SwiGLU 4x, grouped K/V heads (half), an explicit head_dim."""
    return {"intermediate_size": 4 * h, "num_key_value_heads": max(1, n // 2), "head_dim": h // n}


def _ffn(key: str) -> Callable[[int, int, int, int], dict[str, Any]]:
    return lambda h, nl, n, L: {key: 4 * h}


_TOKENS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}
_BERT = Wiring(
    ("self.query:q", "self.key:k", "self.value:v", "output.dense:out"), core="self", spec=CoreSpec()
)
_OUT_PROJ = ("q_proj:q", "k_proj:k", "v_proj:v", "out_proj:out")
_NORMED = Wiring(read_early=("q", "k"))  # q_norm / k_norm read Q and K as soon as projected
_BERT_SUBLAYERS = ("attention", "output")  # output: the MLP's down projection and its norm
_FC_SUBLAYERS = ("self_attn", "fc2")  # no MLP module: its last linear layer (OPT, BART)

TABLE: dict[str, Family] = {
    "bert": Family("BertConfig", _BERT, extra=_ffn("intermediate_size"), head="masked",
                   positions_extra=2, sublayers=_BERT_SUBLAYERS),
    "roberta": Family("RobertaConfig", _BERT, extra=_ffn("intermediate_size"), head="masked",
                      ids=_TOKENS, positions_extra=2, sublayers=_BERT_SUBLAYERS),
    "distilbert": Family("DistilBertConfig", Wiring(
        ("q_lin:q", "k_lin:k", "v_lin:v", "out_lin:out"), spec=CoreSpec()),
        keys=("dim", "n_layers", "n_heads", "max_position_embeddings"), extra=_ffn("hidden_dim"),
        head="masked", sublayers=("attention", "ffn")),
    "gpt2": Family("GPT2Config", Wiring(
        ("c_attn:qkv", "c_proj:out"), cross=("q_attn:q", "c_attn:kv", "c_proj:out"),
        spec=CoreSpec(probs_to_value_dtype=True, contiguous_out=False)),
        keys=("n_embd", "n_layer", "n_head", "n_positions"), sublayers=("attn", "mlp")),
    "gpt_neo": Family(  # no 1/sqrt(d), fp32 q and k, its own causal / windowed mask buffer
        "GPTNeoConfig", Wiring(_OUT_PROJ, patch=("_attn", gpt_neo_attn), spec=CoreSpec(
            upcast_qk=True, scale=False, probs_to_value_dtype=True, transpose_out=False)),
        keys=("hidden_size", "num_layers", "num_heads", "max_position_embeddings"),
        extra=lambda h, nl, n, L: {
            "attention_types": [[["global", "local"], nl // 2]]
            + ([[["global"], 1]] if nl % 2 else []),
            "window_size": max(4, L // 8),
        },
        sdpa=False,  # no SDPA path in transformers 5.x: eager is its default
        sublayers=("attn", "mlp"),
    ),
    "gpt_neox": Family("GPTNeoXConfig", Wiring(("query_key_value:qkv", "dense:out"),
                                               interleaved=True),
                       extra=lambda h, nl, n, L: {"intermediate_size": 4 * h, "rope_parameters": {
                           "rope_type": "default", "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.25}},  # Pythia's partial rotary
                       sublayers=("attention", "mlp")),
    "opt": Family("OPTConfig", Wiring(_OUT_PROJ, read_early=("q",)),  # q_proj(x) * scaling
                  extra=lambda h, nl, n, L: {"ffn_dim": 4 * h, "word_embed_proj_dim": h},
                  ids=_TOKENS, sublayers=_FC_SUBLAYERS),
    "bart": Family(  # encoder, causal decoder, decoder cross-attention to the encoder
        "BartConfig", Wiring(_OUT_PROJ, spec=CoreSpec()),
        keys=("d_model", "encoder_layers", "encoder_attention_heads", "max_position_embeddings"),
        extra=lambda h, nl, n, L: {"decoder_layers": nl, "decoder_attention_heads": n,
                                   "encoder_ffn_dim": 4 * h, "decoder_ffn_dim": 4 * h},
        head="seq2seq", sublayers=_FC_SUBLAYERS),
    "llama": Family("LlamaConfig", extra=_rotary),
    "mistral": Family("MistralConfig", extra=lambda h, nl, n, L: _rotary(h, nl, n, L)
                      | {"sliding_window": max(4, L // 8)}, ids=_TOKENS),
    "qwen2": Family("Qwen2Config", extra=_rotary),
    "qwen3": Family("Qwen3Config", _NORMED, extra=_rotary),  # per-head q_norm / k_norm
    "olmo2": Family("Olmo2Config", _NORMED, extra=_rotary, ids=_TOKENS),  # norms over heads
    "phi3": Family("Phi3Config", Wiring(("qkv_proj:qkv", "o_proj:out")),
                   extra=lambda h, nl, n, L: _rotary(h, nl, n, L)
                   | {"partial_rotary_factor": 0.5}, ids=_TOKENS),
    "gemma2": Family(  # logit soft-capping, query_pre_attn_scalar, local/global layers
        "Gemma2Config",
        extra=lambda h, nl, n, L: _rotary(h, nl, n, L)
        | {"query_pre_attn_scalar": 2 * (h // n), "sliding_window": max(4, L // 8)},
        sdpa=False,  # transformers: "sdpa does not support softcapping"
        ids=_TOKENS,
    ),
}  # fmt: skip
"""Every family protect_ is tested on: the CLI's choices, the campaigns' families and the
parametrised tests come from here."""

FAMILIES = tuple(TABLE)
