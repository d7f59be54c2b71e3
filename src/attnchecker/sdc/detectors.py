"""Detectors side by side on the same simulated SDC.

One training run under an :class:`~attnchecker.sdc.faults.SDCModel` (faults inside attention at
the named sites, q .. out, and at the MLP outputs; from ``onset`` on) is watched by four
detectors at once, beside a healthy twin that trains on the same data:

- ``loss_check``: NaN/INF loss or gradient norm, or a loss above 10x the max of the first 100
  (the common practice, e.g. Megatron's rerun state machine);
- ``step_replay``: every step is run twice on the same (faulty) hardware and the gradients are
  compared bitwise (torchtitan-style replay; SDC is transient, so the two runs differ);
- ``replica_check``: every ``replica_every`` steps the parameters are compared with the healthy
  replica's (a cross-replica consistency check);
- ``abft``: ``protect_`` events.

For each: whether it fired, the step of its first alarm (latency from the onset) and, on a
clean run of the same setup, whether it raised a false alarm. Costs are measured apart.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from attnchecker.attention.config import ABFTConfig
from attnchecker.sdc.faults import STUDY_NODE, SDCModel
from attnchecker.sdc.lockstep import (
    LockstepConfig,
    batch_inputs,
    boundaries,
    output_tensor,
    token_batches,
)

__all__ = ["DETECTORS", "DetectorTrial", "run_detectors"]

DETECTORS = ("loss_check", "step_replay", "replica_check", "abft")


@dataclass(frozen=True, kw_only=True)
class DetectorTrial:
    family: str = "llama"
    steps: int = 12
    onset: int = 4
    replica_every: int = 4
    seed: int = 0
    data: tuple[str, ...] | None = None
    sdc: SDCModel = STUDY_NODE


def _run(trial: DetectorTrial, *, faulty: bool) -> dict[str, int | None]:
    from attnchecker.models.protect import protect_
    from attnchecker.models.tiny import build
    from attnchecker.recovery.checkpoint import NonTrainableDetector

    cfg = LockstepConfig(family=trial.family, steps=trial.steps, seed=trial.seed, data=trial.data)
    blocks = token_batches(cfg)
    base = build(trial.family, seed=trial.seed, vocab_size=blocks.vocab_size, max_len=cfg.seq_len)
    base.config.use_cache = False
    base.train()
    model, twin = copy.deepcopy(base), copy.deepcopy(base)
    handle = protect_(model, ABFTConfig(policy="warn"))
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=cfg.lr) for m in (model, twin))
    sdc = SDCModel(**{**trial.sdc.__dict__, "onset": trial.onset}) if faulty else None
    gen = torch.Generator().manual_seed(trial.seed + 17)
    state = {"step": 0}

    def at_site(call) -> None:
        if sdc is not None and sdc.active(state["step"]) and sdc.forward:
            sdc.corrupt_(call.tensor, site_rate=sdc.rate, generator=gen)

    def at_mlp(module, args, output) -> None:
        t = output_tensor(output)
        if t is not None and sdc is not None and sdc.active(state["step"]) and sdc.forward:
            sdc.corrupt_(t.data, site_rate=sdc.mlp_rate, generator=gen)

    handle.attach(at_site)
    hooks = [
        m.register_forward_hook(at_mlp) for _, _, kind, m in boundaries(model) if kind == "mlp"
    ]
    first: dict[str, int | None] = dict.fromkeys(DETECTORS)
    loss_check = NonTrainableDetector()

    def grads_of(step: int) -> tuple[float, torch.Tensor, float]:
        torch.manual_seed(step)
        loss = model(**batch_inputs(blocks, step, cfg, trial.seed)).loss
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.zero_grad(set_to_none=True)
        return loss.item(), g, float(g.norm())

    for step in range(1, trial.steps + 1):
        state["step"] = step
        loss, g1, norm = grads_of(step)
        _, g2, _ = grads_of(step)  # the replay
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            events = handle.drain()
        fired = {
            "loss_check": loss_check(loss, norm) is not None,
            "step_replay": not torch.equal(g1.nan_to_num(), g2.nan_to_num()),
            "abft": bool(events),
        }
        offset = 0
        for p in model.parameters():  # update with the first run's gradients
            p.grad = g1[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        twin(**batch_inputs(blocks, step, cfg, trial.seed)).loss.backward()
        opt_twin.step()
        opt_twin.zero_grad(set_to_none=True)
        if step % trial.replica_every == 0:
            fired["replica_check"] = any(
                not torch.equal(p, q)
                for p, q in zip(model.parameters(), twin.parameters(), strict=True)
            )
        for name, hit in fired.items():
            if hit and first[name] is None:
                first[name] = step
    for h in hooks:
        h.remove()
    return first


def run_detectors(trial: DetectorTrial) -> dict[str, Any]:
    """One faulty and one clean run of ``trial``: per detector, fired, latency, false alarm."""
    faulty, clean = _run(trial, faulty=True), _run(trial, faulty=False)
    return {
        name: {
            "detected": faulty[name] is not None,
            "latency_steps": None if faulty[name] is None else faulty[name] - trial.onset,
            "false_alarm": clean[name] is not None,
        }
        for name in DETECTORS
    }
