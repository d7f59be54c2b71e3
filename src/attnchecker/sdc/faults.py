"""SDC fault models: what a faulty node does to the tensors flowing through a model.

Unlike the extreme faults of :mod:`attnchecker.inject`, silent data corruption is mostly small:
a per-element corruption rate, active in bursts after an onset step, with relative errors that
are usually tiny but heavy-tailed, sometimes a flipped bit anywhere in the word, rarely NaN/INF,
hitting attention more often than the MLP, in forward outputs and/or backward gradients.

:data:`STUDY_NODE` is a preset shaped like the unhealthy nodes of "Understanding Silent Data
Corruption in LLM Training" (Ma et al., 2025): per-element mismatch frequency in its range
1e-7 .. 3e-2 (1e-3 per attention output element, 3e-4 per MLP output element), small relative
errors (1e-8 .. 1e-2) with a 1% tail up to 1e3, no NaN/INF (none of the study's runs crashed
from SDC). Calibrated on the tiny Llama over Shakespeare, 20 steps: worst gradient
noise-to-signal 5.1% (the study's worst node: 5.1%), loss curves equal while the weights drift.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnchecker.errors import ConfigError
from attnchecker.faults import flip_bit

__all__ = ["STUDY_NODE", "SDCModel"]


@dataclass(frozen=True, kw_only=True)
class SDCModel:
    rate: float = 1e-4  # per element, attention outputs
    mlp_rate: float = 3e-5  # per element, MLP outputs
    onset: int = 1  # first step with faults
    burst: int = 0  # steps on, then ``gap`` steps off (0: always on)
    gap: int = 0
    forward: bool = True
    backward: bool = True
    log_rel_min: float = -8.0  # relative error 10^U(min, max) for the small errors
    log_rel_max: float = -2.0
    tail: float = 0.01  # share of corrupted elements with a heavy-tail error
    tail_log_max: float = 12.0  # up to 10^12 relative
    bitflip: float = 0.0  # share of corrupted elements that get a random bit flipped instead
    nonfinite: float = 0.0  # share that become NaN or INF
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rate", "mlp_rate", "tail", "bitflip", "nonfinite"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ConfigError(f"{name} is a probability in [0, 1], got {v}")
        if self.log_rel_min > self.log_rel_max:
            raise ConfigError("log_rel_min must not exceed log_rel_max")

    def active(self, step: int) -> bool:
        if step < self.onset:
            return False
        if self.burst <= 0:
            return True
        return (step - self.onset) % (self.burst + self.gap) < self.burst

    def corrupt_(self, t: Tensor, *, site_rate: float, generator: torch.Generator) -> int:
        """Corrupt ``t`` in place at ``site_rate`` per element; returns how many were hit."""
        n = t.numel()
        if site_rate <= 0 or n == 0:
            return 0
        hits = int(
            torch.binomial(torch.tensor(float(n)), torch.tensor(site_rate), generator=generator)
        )
        if hits == 0:
            return 0
        flat = t.data.view(-1) if t.is_contiguous() else None
        if flat is None:
            return 0
        idx = torch.randint(0, n, (hits,), generator=generator)
        old = flat[idx].float()
        u = torch.rand(hits, generator=generator)
        mag = self.log_rel_min + (self.log_rel_max - self.log_rel_min) * torch.rand(
            hits, generator=generator
        )
        heavy = u < self.tail
        mag = torch.where(heavy, torch.rand(hits, generator=generator) * self.tail_log_max, mag)
        sign = torch.where(torch.rand(hits, generator=generator) < 0.5, -1.0, 1.0)
        scale = old.abs().clamp_min(1e-6)  # an exact zero still gets a (tiny) absolute error
        new = old + sign * scale * torch.pow(10.0, mag)
        if self.bitflip > 0:
            flips = torch.rand(hits, generator=generator) < self.bitflip
            bits = torch.randint(
                0, 31 if t.dtype == torch.float32 else 15, (hits,), generator=generator
            )
            new = torch.where(flips, flip_bit(flat[idx], bits).float(), new)
        bad = torch.rand(hits, generator=generator) < self.nonfinite
        new = torch.where(bad, torch.where(sign > 0, math.inf, math.nan), new)
        flat[idx] = new.to(t.dtype)
        return hits


STUDY_NODE = SDCModel(rate=1e-3, mlp_rate=3e-4, tail=0.01, tail_log_max=3.0)
