"""Small offline configurations of every supported family, for tests, demos and benchmarks.

Models are built from configs with random initialisation (nothing is downloaded) and use the
eager attention, which is the math the protected core reproduces.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from attnchecker.errors import ConfigError
from attnchecker.models.families import FAMILIES, TABLE

__all__ = ["FAMILIES", "SIZES", "TABLE", "build", "family_config", "from_file", "no_dropout"]


_SHAPES = {  # hidden, layers, heads
    "tiny": (32, 2, 4),
    "small": (256, 4, 4),
    "base": (768, 4, 12),
}
SIZES = tuple(_SHAPES)
"""The model sizes :func:`build` and :func:`family_config` know."""


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
        raise ConfigError(f"unknown family {family!r}; choose from {FAMILIES}")
    if size not in _SHAPES:
        raise ConfigError(f"unknown size {size!r}; choose from {sorted(_SHAPES)}")
    fam = TABLE[family]
    hidden, default_layers, heads = _SHAPES[size]
    layers = default_layers if layers is None else layers
    k_hidden, k_layers, k_heads, k_positions = fam.keys
    kwargs = {k_hidden: hidden, k_layers: layers, k_heads: heads}
    kwargs[k_positions] = max_len + fam.positions_extra
    kwargs |= fam.extra(hidden, layers, heads, max_len) | fam.ids
    cls = getattr(tf, fam.config)
    defaults = cls()
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the original vocabulary's
        v = getattr(defaults, k, None)
        if k not in kwargs and isinstance(v, int) and v >= vocab_size:
            kwargs[k] = None  # beyond the tiny vocabulary (GPT-2's 50256): unused, not a warning
    cfg = cls(vocab_size=vocab_size, **kwargs)
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
    if cfg.model_type in TABLE:
        head = TABLE[cfg.model_type].head
    else:  # the generic path: what transformers itself maps the config to
        head = "seq2seq" if cfg.is_encoder_decoder else "causal"
        if head == "causal" and type(cfg) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
            head = "masked"
    return _instantiate(cfg, head=head, task=task, seed=seed)


def no_dropout(family: str, size: str = "tiny") -> dict[str, float]:
    """Overrides of :func:`build` that set every dropout probability of ``family``'s config to
    0 (attention dropout in training runs the fused kernels' calls on the eager engine)."""
    cfg = family_config(family, size).to_dict()
    return {k: 0.0 for k, v in cfg.items()
            if isinstance(v, float) and ("dropout" in k or "pdrop" in k)}  # fmt: skip


def build(
    family: str, size: str = "tiny", *, task: str = "lm", seed: int = 0, **overrides: Any
) -> nn.Module:
    """A randomly initialised model: masked LM for BERT/RoBERTa, causal LM for decoders
    (``task="lm"``), or sequence classification with 2 labels (``task="cls"``)."""
    cfg = family_config(family, size, **overrides)
    return _instantiate(cfg, head=TABLE[family].head, task=task, seed=seed)


_HEADS = {  # the family's LM head: its transformers auto class
    "causal": "AutoModelForCausalLM",
    "masked": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}


def _instantiate(cfg, *, head: str, task: str, seed: int) -> nn.Module:
    """The randomly initialised model of ``cfg`` for ``task``, in eager attention: its LM
    (``"lm"``: causal, masked or sequence-to-sequence), or sequence classification with 2
    labels (``"cls"``)."""
    import torch
    import transformers as tf

    if task == "cls":
        cfg.num_labels = 2
        if head != "masked" and cfg.pad_token_id is None:
            cfg.pad_token_id = 0
        auto = tf.AutoModelForSequenceClassification
    elif task == "lm":
        auto = getattr(tf, _HEADS[head])
    else:
        raise ValueError(f"task must be 'lm' or 'cls', got {task!r}")
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation="eager")
    if model.loss_type is None:  # GPT2LMHeadModel: its name maps to no loss, so transformers
        model.loss_type = "ForCausalLM"  # warns at every compile (a graph break) and falls back
    return model
