"""Small offline configurations of every supported family, for tests, demos and benchmarks.

Models are built from configs with random initialisation (nothing is downloaded) and use the
eager attention, which is the math the protected core reproduces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["FAMILIES", "TABLE", "Family", "build", "family_config", "from_file"]


@dataclass(frozen=True)
class Family:
    """One supported family as the tiny / small / base configs build it: its transformers config
    class, the config keys of (hidden, layers, heads, positions), what else a size implies, and
    how the family is trained and run by default."""

    config: str  # transformers config class
    keys: tuple[str, str, str, str] = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
    )  # fmt: skip
    extra: Callable[[int, int, int, int], dict[str, Any]] = lambda h, nl, n, L: {}
    decoder: bool = True  # causal LM (else masked LM)
    sdpa: bool = True  # transformers has an SDPA path for it (the users' default)
    ids: dict[str, int] = field(default_factory=dict)  # special tokens inside the tiny vocab
    positions_extra: int = 0  # BERT-style position tables hold max_len + 2


def _rotary(h: int, nl: int, n: int, L: int) -> dict[str, Any]:
    """Llama-style decoders: SwiGLU 4x, grouped K/V heads (half), an explicit head_dim."""
    return {"intermediate_size": 4 * h, "num_key_value_heads": max(1, n // 2), "head_dim": h // n}


_TOKENS = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}

TABLE: dict[str, Family] = {
    "bert": Family("BertConfig", extra=lambda h, nl, n, L: {"intermediate_size": 4 * h},
                   decoder=False, positions_extra=2),
    "roberta": Family("RobertaConfig", extra=lambda h, nl, n, L: {"intermediate_size": 4 * h},
                      decoder=False, ids=_TOKENS, positions_extra=2),
    "gpt2": Family("GPT2Config", keys=("n_embd", "n_layer", "n_head", "n_positions")),
    "gpt_neo": Family(
        "GPTNeoConfig", keys=("hidden_size", "num_layers", "num_heads", "max_position_embeddings"),
        extra=lambda h, nl, n, L: {
            "attention_types": [[["global", "local"], nl // 2]]
            + ([[["global"], 1]] if nl % 2 else []),
            "window_size": max(4, L // 8),
        },
        sdpa=False,  # no SDPA path in transformers 5.x: eager is its default
    ),
    "llama": Family("LlamaConfig", extra=_rotary),
    "mistral": Family("MistralConfig", extra=lambda h, nl, n, L: _rotary(h, nl, n, L)
                      | {"sliding_window": max(4, L // 8)}, ids=_TOKENS),
    "qwen2": Family("Qwen2Config", extra=_rotary),
    "qwen3": Family("Qwen3Config", extra=_rotary),  # per-head q_norm / k_norm before RoPE
    "olmo2": Family("Olmo2Config", extra=_rotary, ids=_TOKENS),  # q_norm / k_norm over heads
    "phi3": Family("Phi3Config", extra=lambda h, nl, n, L: _rotary(h, nl, n, L)
                   | {"partial_rotary_factor": 0.5}, ids=_TOKENS),  # fused qkv_proj
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

_SIZES = {  # hidden, layers, heads
    "tiny": (32, 2, 4),
    "small": (256, 4, 4),
    "base": (768, 4, 12),
}


def family_config(
    family: str,
    size: str = "tiny",
    *,
    layers: int | None = None,
    vocab_size: int = 128,
    max_len: int = 64,
    **overrides: Any,
):
    """A transformers config for ``family`` at ``size`` (tiny, small, base = hidden 768)."""
    import transformers as tf

    if family not in TABLE:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(_SIZES)}")
    fam = TABLE[family]
    hidden, default_layers, heads = _SIZES[size]
    layers = default_layers if layers is None else layers
    k_hidden, k_layers, k_heads, k_positions = fam.keys
    kwargs = {k_hidden: hidden, k_layers: layers, k_heads: heads}
    kwargs[k_positions] = max_len + fam.positions_extra
    kwargs |= fam.extra(hidden, layers, heads, max_len) | fam.ids
    cfg = getattr(tf, fam.config)(vocab_size=vocab_size, **kwargs)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def from_file(path: str, *, task: str = "lm", seed: int = 0, **overrides: Any) -> nn.Module:
    """A randomly initialised model from the user's own transformers config: a ``config.json``
    or a directory holding one (nothing is downloaded), in eager attention; ``overrides`` are
    set on the config (the training loop sets its tokenizer's vocabulary size; special token ids
    beyond it are dropped)."""
    import json
    from pathlib import Path

    import transformers as tf

    from attnchecker.errors import ConfigError

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        raw = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read a transformers config from {path}: {e}") from None
    if "model_type" not in raw:
        raise ConfigError(f"{file} has no model_type: not a transformers config")
    cfg = tf.AutoConfig.for_model(**raw)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids of the original vocabulary
        if isinstance(getattr(cfg, k, None), int) and getattr(cfg, k) >= cfg.vocab_size:
            setattr(cfg, k, None)  # beyond a smaller training vocabulary: unused here
    decoder = TABLE[cfg.model_type].decoder if cfg.model_type in TABLE else True
    return _instantiate(cfg, decoder=decoder, task=task, seed=seed)


def build(
    family: str, size: str = "tiny", *, task: str = "lm", seed: int = 0, **overrides: Any
) -> nn.Module:
    """A randomly initialised model: masked LM for BERT/RoBERTa, causal LM for decoders
    (``task="lm"``), or sequence classification with 2 labels (``task="cls"``)."""
    cfg = family_config(family, size, **overrides)
    return _instantiate(cfg, decoder=TABLE[family].decoder, task=task, seed=seed)


def _instantiate(cfg, *, decoder: bool, task: str, seed: int) -> nn.Module:
    """The randomly initialised model of ``cfg`` for ``task``, in eager attention: causal or
    masked LM (``"lm"``), or sequence classification with 2 labels (``"cls"``)."""
    import torch
    import transformers as tf

    if task == "cls":
        cfg.num_labels = 2
        if decoder and cfg.pad_token_id is None:
            cfg.pad_token_id = 0
        auto = tf.AutoModelForSequenceClassification
    elif task == "lm":
        auto = tf.AutoModelForCausalLM if decoder else tf.AutoModelForMaskedLM
    else:
        raise ValueError(f"task must be 'lm' or 'cls', got {task!r}")
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation="eager")
    if model.loss_type is None:  # GPT2LMHeadModel: its name maps to no loss, so transformers
        model.loss_type = "ForCausalLM"  # warns at every compile (a graph break) and falls back
    return model
