"""Capture -> dump -> compare: per-step numerical fingerprints of a run, compared from files.

:class:`Recorder` writes one JSON line per (step, module, phase) for every attention and MLP
boundary of a model, forward outputs and the gradients flowing back into them: float64 sum,
L2 norm, max |x|, non-finite count and a cheap bit-exact hash. Never a tensor copy. Two runs on
two machines record independently; :func:`compare` reads both files and reports the first
divergent (step, module, phase) and the relative drift of the norms per step, symmetrically.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnchecker.sdc.lockstep import boundaries, output_tensor

__all__ = ["Recorder", "compare", "fingerprint", "record_run"]

SCHEMA_VERSION = 1
_MOD = (1 << 61) - 1


@torch.no_grad()
def fingerprint(t: Tensor) -> dict[str, Any]:
    """Reduced statistics of ``t`` in float64 and a position-weighted hash of its bits."""
    x = t.detach()
    d = x.double()
    finite = d.isfinite()
    bits = (
        x.contiguous().view(-1).view(torch.int16 if x.element_size() == 2 else torch.int32).long()
    )
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.long) % 65_521 + 1
    return {
        "sum": float(d[finite].sum()),
        "norm": float(d[finite].norm()),
        "absmax": float(d[finite].abs().max()) if finite.any() else 0.0,
        "nonfinite": int((~finite).sum()),
        "hash": int((bits * weights).sum() % _MOD),
    }


class Recorder:
    """Context manager: fingerprints of every boundary, forward and backward, to ``path``."""

    def __init__(self, model: nn.Module, path: str | Path) -> None:
        self.model, self.path = model, Path(path)
        self.step = 0
        self._handles: list[Any] = []

    def __enter__(self) -> Recorder:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w")

        def tick(*_: object) -> None:
            self.step += 1

        self._handles.append(self.model.register_forward_pre_hook(tick))
        for name, _, _, module in boundaries(self.model):
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def _write(self, name: str, phase: str, t: Tensor) -> None:
        row = {"schema_version": SCHEMA_VERSION, "step": self.step, "module": name, "phase": phase}
        self._file.write(json.dumps(row | fingerprint(t)) + "\n")

    def _hook(self, name: str):
        def hook(module: nn.Module, args: object, output: object) -> None:
            t = output_tensor(output)
            if t is None:
                return
            self._write(name, "forward", t)
            if t.requires_grad:
                t.register_hook(lambda g: self._write(name, "backward", g))

        return hook

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._file.close()


def _load(path: str | Path) -> dict[tuple[int, str, str], dict[str, Any]]:
    rows = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[(r["step"], r["module"], r["phase"])] = r
    return rows


def compare(a: str | Path, b: str | Path) -> dict[str, Any]:
    """First divergent (step, module, phase) and per-step norm drift of two recordings."""
    ra, rb = _load(a), _load(b)
    common = sorted(set(ra) & set(rb), key=lambda k: (k[0], k[2] == "backward", k[1]))
    first = next(
        (
            {"step": k[0], "module": k[1], "phase": k[2]}
            for k in common
            if ra[k]["hash"] != rb[k]["hash"]
        ),
        None,
    )
    drift: dict[int, float] = defaultdict(float)
    for k in common:
        na, nb = ra[k]["norm"], rb[k]["norm"]
        drift[k[0]] = max(drift[k[0]], abs(na - nb) / max(abs(na), abs(nb), 1e-300))
    return {
        "compared": len(common),
        "only_in_one": len(set(ra) ^ set(rb)),
        "identical": first is None,
        "first_divergence": first,
        "max_norm_drift_by_step": dict(sorted(drift.items())),
        "nonfinite": {
            "a": sum(r["nonfinite"] for r in ra.values()),
            "b": sum(r["nonfinite"] for r in rb.values()),
        },
    }


def record_run(
    path: str | Path, *, family: str = "llama", size: str = "tiny", steps: int = 10, seed: int = 0,
    data: tuple[str, ...] | None = None, sdc=None,
) -> Path:  # fmt: skip
    """Train ``steps`` steps (optionally under an SDC model) and record their fingerprints."""
    from attnchecker.models.tiny import build
    from attnchecker.sdc.lockstep import (
        LockstepConfig,
        Replica,
        batch_inputs,
        corrupting,
        token_batches,
    )

    cfg = LockstepConfig(family=family, size=size, steps=steps, seed=seed, data=data)
    torch.manual_seed(seed)
    blocks = token_batches(cfg)
    model = build(family, size, seed=seed, vocab_size=blocks.vocab_size, max_len=cfg.seq_len)
    model.config.use_cache = False
    model.train()
    replica = Replica(model, cfg.lr)
    gen = torch.Generator().manual_seed(0 if sdc is None else sdc.seed)
    with Recorder(model, path):
        for step in range(1, steps + 1):
            hook = None if sdc is None else corrupting(sdc, step, gen)
            replica.step(batch_inputs(blocks, step, cfg, seed), step, hook)
            replica.update()
    return Path(path)
