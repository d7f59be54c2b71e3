"""Checkpoint / restore, the baseline protection is compared with.

A checkpoint is a directory ``step-000120/`` holding ``tensors.safetensors`` (model parameters,
optimizer state tensors, the torch RNG state) and ``meta.json`` (step, which is also the data
position, optimizer scalars and param groups, the LR scheduler's state, the SHA-256 of the
tensor file). It is written to a temporary directory and
renamed into place, so a crash never leaves a half checkpoint under a real name. Loading never
unpickles anything; a checkpoint whose hash, size or JSON does not check out raises
:class:`CheckpointError` and :meth:`CheckpointManager.restore` falls back to the previous one.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnchecker.errors import CheckpointError, ConfigError

__all__ = ["CheckpointError", "CheckpointManager", "NonTrainableDetector", "save_weights"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the second name of tied weights (GPT-2's lm_head is wte)."""
    seen: set[int] = set()
    out = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            out[k] = v
    return out


def _load_unique_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing = set(model.state_dict()) - set(state)
    if missing - (set(model.state_dict()) - set(_unique_state(model))):
        raise CheckpointError(f"checkpoint lacks {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False)  # tied names follow their storage


class CheckpointManager:
    """Save every ``every`` steps into ``directory``, keep the newest ``keep``."""

    def __init__(self, directory: str | Path, *, every: int, keep: int = 2) -> None:
        if every < 1 or keep < 1:
            raise ConfigError(f"every and keep must be >= 1, got every={every}, keep={keep}")
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def steps(self) -> list[int]:
        return sorted(
            int(p.name.split("-")[1]) for p in self.directory.glob("step-*") if p.is_dir()
        )

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}"

    def clear(self, keep: int = 0) -> None:
        """Delete all but the newest ``keep`` checkpoints (all of them by default: a fresh run)."""
        steps = self.steps()
        for old in steps[: max(0, len(steps) - keep)]:
            shutil.rmtree(self._path(old), ignore_errors=True)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        **extra: Any,
    ) -> Path:
        from safetensors.torch import save_file

        tensors = {f"model.{k}": v.detach().contiguous() for k, v in _unique_state(model).items()}
        opt = optimizer.state_dict()
        scalars: dict[str, Any] = {}
        for pid, state in opt["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value):
                    tensors[f"optim.{pid}.{key}"] = value.detach().contiguous()
                else:
                    scalars[f"{pid}.{key}"] = value
        tensors["rng.torch"] = torch.get_rng_state()
        final = self._path(step)
        tmp = self.directory / f".tmp-{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(tensors, str(tmp / "tensors.safetensors"))
        meta = {
            "step": step,
            "optimizer_scalars": scalars,
            "param_groups": opt["param_groups"],
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "sha256": _sha256(tmp / "tensors.safetensors"),
            "extra": extra,
        }
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self.clear(keep=self.keep)
        return final

    def load(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> dict[str, Any]:
        """Load one checkpoint into ``model`` and ``optimizer``; returns its metadata."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self._path(step)
        try:
            meta = json.loads((path / "meta.json").read_text())
            if _sha256(path / "tensors.safetensors") != meta["sha256"]:
                raise CheckpointError(f"{path}: tensor file does not match its recorded SHA-256")
            tensors = load_file(str(path / "tensors.safetensors"))
        except (OSError, json.JSONDecodeError, KeyError, SafetensorError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from e
        _load_unique_state(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        state: dict[int, dict[str, Any]] = {}
        for k, v in tensors.items():
            if k.startswith("optim."):
                _, pid, key = k.split(".", 2)
                state.setdefault(int(pid), {})[key] = v
        for k, v in meta["optimizer_scalars"].items():
            pid, key = k.split(".", 1)
            state.setdefault(int(pid), {})[key] = v
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])
        torch.set_rng_state(tensors["rng.torch"])
        return meta

    def restore(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
    ) -> dict[str, Any]:
        """Load the newest valid checkpoint, falling back to older ones; raises if none loads."""
        errors = []
        for step in reversed(self.steps()):
            try:
                return self.load(step, model, optimizer, scheduler)
            except CheckpointError as e:
                errors.append(str(e))
        raise CheckpointError(
            "no valid checkpoint in " + str(self.directory) + ": " + "; ".join(errors)
        )


class NonTrainableDetector:
    """A non-trainable step: a NaN/INF loss or gradient norm, or a loss spike above ``factor``
    times the maximum of the first ``warmup`` losses (checked once those are seen)."""

    def __init__(self, factor: float = 10.0, warmup: int = 100) -> None:
        self.factor, self.warmup = factor, warmup
        self.first: list[float] = []

    def __call__(self, loss: float, grad_norm: float) -> str | None:
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return "non_finite"
        if len(self.first) >= min(self.warmup, 3) and loss > self.factor * max(self.first):
            return "spike"
        if len(self.first) < self.warmup:
            self.first.append(loss)
        return None


def save_weights(model: nn.Module, path: str | Path) -> None:
    """The model's weights as safetensors (tied weights stored once)."""
    from safetensors.torch import save_model

    save_model(model, str(path))
