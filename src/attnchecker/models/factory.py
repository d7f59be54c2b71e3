"""The user's own PyTorch model from a Python factory, ``package.module:function``, for the
training loop and campaigns (``attnchecker train --model package.module:function``,
``attnchecker campaign --families package.module:function``).

The module is imported from the path, else from the working directory. The factory is called
as ``function(vocab_size=..., seq_len=...)`` (the loop's tokenizer and block length; the
global generator seeded first) and returns a model that maps token ids
(B, T) to logits (B, T, V) (or an output with ``.logits``), or ``(model, loss)`` with
``loss(logits, labels)`` its own loss (default: next-token cross-entropy). :class:`OwnModel`
wraps it so the loop calls it as a transformers model: ``(input_ids, attention_mask, labels)``
to an output with ``.loss``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attnchecker.errors import ConfigError

__all__ = ["Output", "OwnModel", "is_factory", "load_factory"]


def is_factory(spec: str) -> bool:
    """Whether ``spec`` reads as ``package.module:function`` (not a path to a config)."""
    module, sep, name = spec.partition(":")
    return bool(sep) and name.isidentifier() and all(p.isidentifier() for p in module.split("."))


class Output(NamedTuple):
    loss: Tensor | None
    logits: Tensor


class OwnModel(nn.Module):
    """The user's model called as the training loop calls a transformers model."""

    def __init__(self, model: nn.Module, loss: Callable[[Tensor, Tensor], Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None
    ) -> Output:
        out = self.model(input_ids)
        logits = getattr(out, "logits", out)  # (B, T, V)
        if labels is None:
            return Output(None, logits)
        if self.loss_fn is not None:
            return Output(self.loss_fn(logits, labels), logits)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return Output(loss, logits)


def _import(module: str):
    """``module``, imported from the path or, as uvicorn's ``module:app``, from the working
    directory (a console script does not put it on the path)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        cwd = os.getcwd()
        if cwd in sys.path:
            raise
        sys.path.insert(0, cwd)
        return importlib.import_module(module)


def load_factory(spec: str, *, vocab_size: int, seq_len: int, seed: int) -> OwnModel:
    """The model that ``spec``'s factory builds, wrapped; raises
    :class:`~attnchecker.errors.ConfigError` naming what is wrong with it."""
    module, _, name = spec.partition(":")
    try:
        factory = getattr(_import(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot load the model factory {spec!r}: {e}") from None
    torch.manual_seed(seed)
    made = factory(vocab_size=vocab_size, seq_len=seq_len)
    model, loss = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"{spec} returned {type(model).__name__}, not a torch.nn.Module (or a (module, loss) "
            f"pair)"
        )
    if loss is not None and not callable(loss):
        raise ConfigError(f"{spec}'s loss is not callable: {loss!r}")
    return OwnModel(model, loss)
