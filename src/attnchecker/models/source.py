"""The model a command names, built in one place: a family of the table (``gpt2``, at a
size), the user's own transformers config (a ``config.json``, or a directory holding one) or
the user's own PyTorch model from a Python factory (``package.module:function``).

``train --model``, ``campaign --families``, ``bench`` and ``validate`` all build their models
here, randomly initialised (nothing is downloaded), in training mode and without a KV cache, so
a plan is priced and validated on the model that will train, not on a preset.
"""

from __future__ import annotations

import contextlib
import copy
import re
from pathlib import Path

from torch import Tensor, nn

from attnchecker.errors import ConfigError

__all__ = ["example", "kind_of", "make", "plain", "tag"]

VOCAB = 128  # campaigns and benches draw token ids below this (and Shakespeare as ASCII ids)


def kind_of(name: str) -> str:
    """``"family"``, ``"factory"`` or ``"config"``; raises :class:`ConfigError` saying what a
    model can be named as when ``name`` is none of them."""
    from attnchecker.models.factory import is_factory
    from attnchecker.models.families import FAMILIES, TABLE

    if name in TABLE:
        return "family"
    if is_factory(name):
        return "factory"
    p = Path(name)
    if p.exists() or p.suffix == ".json" or "/" in name:  # a path: read (or refused) as one
        return "config"
    raise ConfigError(
        f"unknown model {name!r}: name a family ({', '.join(FAMILIES)}), a transformers "
        f"config.json (or a directory with one), or a factory as package.module:function"
    )


def make(
    name: str,
    *,
    size: str = "tiny",
    task: str = "lm",
    seed: int = 0,
    vocab_size: int | None = None,
    seq_len: int = 64,
    max_len: int | None = None,
    layers: int | None = None,
    dropout: bool = True,
) -> nn.Module:
    """The model ``name`` names, randomly initialised from ``seed``, in training mode, no KV
    cache. ``vocab_size``: the tokenizer's (None: a family's own tiny vocabulary, 128 for the
    others); ``max_len``: a family's positions (None: ``max(64, seq_len)``); ``size``,
    ``layers`` and ``dropout=False`` (every dropout probability 0) shape a family only (the
    user's own models are theirs)."""
    from attnchecker.models.factory import load_factory
    from attnchecker.models.tiny import build, from_file, no_dropout

    kind = kind_of(name)
    if not dropout and kind != "family":
        raise ConfigError(f"dropout off is for a family's preset; {name!r} is the user's own")
    if kind == "factory":
        if task != "lm":
            raise ConfigError("a model from a factory trains task 'lm' (next-token prediction)")
        model = load_factory(name, vocab_size=vocab_size or VOCAB, seq_len=seq_len, seed=seed)
        model.train()
        return model
    if kind == "config":
        model = from_file(name, task=task, seed=seed, vocab_size=vocab_size or VOCAB)
    else:
        extra = {} if vocab_size is None else {"vocab_size": vocab_size}
        extra |= {} if layers is None else {"layers": layers}
        extra |= {} if dropout else no_dropout(name, size)
        positions = max(64, seq_len) if max_len is None else max_len
        model = build(name, size, task=task, seed=seed, max_len=positions, **extra)
    model.config.use_cache = False
    model.train()
    return model


def plain(model: nn.Module) -> nn.Module:
    """A copy of ``model`` as its user runs it unprotected: transformers' default SDPA attention
    where the model has it (GPT-Neo has none: eager), the user's own model as it is."""
    from attnchecker.models.families import TABLE

    out = copy.deepcopy(model)
    if not hasattr(out, "set_attn_implementation"):
        return out
    family = TABLE.get(out.config.model_type)
    if family is not None and not family.sdpa:
        return out
    with contextlib.suppress(ValueError, ImportError):  # transformers has no SDPA path for it
        out.set_attn_implementation("sdpa")
    return out


def example(model: nn.Module, ids: Tensor) -> tuple[Tensor, ...] | None:
    """What :func:`~attnchecker.protect_` traces a model of the user's own with (one row of
    token ids); None for a transformers model (its table entry or generic rule finds it)."""
    from attnchecker.models.factory import OwnModel

    return (ids[:1],) if isinstance(model, OwnModel) else None


def tag(name: str) -> str:
    """``name`` as a file name's part (``vulnerability-<tag>.json``): a family as it is; a
    factory's or a config path's separators replaced."""
    return re.sub(r"[^\w.-]+", "_", name).strip("_")
