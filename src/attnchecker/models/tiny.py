"""Small offline configurations of every supported family, for tests, demos and benchmarks.

Models are built from configs with random initialisation (nothing is downloaded) and use the
eager attention, which is the math the protected core reproduces.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["FAMILIES", "build", "family_config"]

FAMILIES = ("bert", "roberta", "gpt2", "gpt_neo", "llama")

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

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(_SIZES)}")
    hidden, default_layers, heads = _SIZES[size]
    layers = default_layers if layers is None else layers
    common: dict[str, Any] = {"vocab_size": vocab_size}
    if family in ("bert", "roberta"):
        cls = tf.BertConfig if family == "bert" else tf.RobertaConfig
        extra = (
            {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2} if family == "roberta" else {}
        )
        cfg = cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * hidden,
            max_position_embeddings=max_len + 2,
            **common,
            **extra,
        )
    elif family == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_len, **common
        )
    elif family == "gpt_neo":
        cfg = tf.GPTNeoConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            max_position_embeddings=max_len,
            attention_types=[[["global", "local"], layers // 2]]
            + ([[["global"], 1]] if layers % 2 else []),
            window_size=max(4, max_len // 8),
            **common,
        )
    else:
        cfg = tf.LlamaConfig(
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            max_position_embeddings=max_len,
            **common,
        )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def build(
    family: str, size: str = "tiny", *, task: str = "lm", seed: int = 0, **overrides: Any
) -> nn.Module:
    """A randomly initialised model: masked LM for BERT/RoBERTa, causal LM for decoders
    (``task="lm"``), or sequence classification with 2 labels (``task="cls"``)."""
    import torch
    import transformers as tf

    cfg = family_config(family, size, **overrides)
    if task == "cls":
        cfg.num_labels = 2
        if family in ("gpt2", "gpt_neo", "llama"):
            cfg.pad_token_id = 0
        auto = tf.AutoModelForSequenceClassification
    elif task == "lm":
        auto = tf.AutoModelForMaskedLM if family in ("bert", "roberta") else tf.AutoModelForCausalLM
    else:
        raise ValueError(f"task must be 'lm' or 'cls', got {task!r}")
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation="eager")
    if model.loss_type is None:  # GPT2LMHeadModel: its name maps to no loss, so transformers
        model.loss_type = "ForCausalLM"  # warns at every compile (a graph break) and falls back
    return model
