"""The lockstep across two processes (``torchrun --nproc_per_node 2``): rank 0 healthy, rank 1
faulty, synchronised by collectives. Two real machines are compared the same way.

Level 1: at every boundary rank 0 broadcasts its tensor (and, in backward, its gradient); rank 1
applies its fault model, compares, and continues with rank 0's tensor. Level 2: rank 0
broadcasts its gradients; rank 1 measures the noise-to-signal ratio, then both step with rank
0's gradients, so parameters and optimizer state stay identical. Level 3: no synchronisation
until the end, when rank 1's parameters go to rank 0 for the drift. With the same seed and fault
model the numbers equal those of :func:`~attnchecker.sdc.lockstep.run_lockstep` in one process.
"""

from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnchecker.sdc.lockstep import (
    LockstepConfig,
    Replica,
    batch_inputs,
    corrupting,
    mismatch,
    mismatch_row,
    output_tensor,
    prediction_divergence,
    setup_run,
)

__all__ = ["run_twin"]


def _from_rank0(t: Tensor, rank: int) -> Tensor:
    """Rank 0's (healthy) value of the tensor both ranks hold as ``t``."""
    out = t.detach().contiguous().clone() if rank == 0 else torch.empty(t.shape, dtype=t.dtype)
    dist.broadcast(out, src=0)
    return out


def _level1_hooks(rank: int, sdc, step: int, gen: torch.Generator, rows: list):
    def hook(name, layer, kind):
        rate = 0.0 if sdc is None else (sdc.rate if kind == "attention" else sdc.mlp_rate)
        on = sdc is not None and sdc.active(step)

        def fwd(module, args, output):
            t = output_tensor(output)
            if t is None:
                return
            healthy = _from_rank0(t, rank)
            if rank == 1:
                if on and sdc.forward:
                    sdc.corrupt_(t.data, site_rate=rate, generator=gen)
                n, sev = mismatch(t, healthy)
                rows.append(mismatch_row(step, name, layer, kind, "forward", t.numel(), n, sev))
                t.data.copy_(healthy)
            if t.requires_grad:

                def on_grad(g: Tensor) -> Tensor | None:
                    hg = _from_rank0(g, rank)
                    if rank == 0:
                        return None
                    g = g.clone()
                    if on and sdc.backward:
                        sdc.corrupt_(g, site_rate=rate, generator=gen)
                    n, sev = mismatch(g, hg)
                    rows.append(
                        mismatch_row(step, name, layer, kind, "backward", g.numel(), n, sev)
                    )
                    return hg

                t.register_hook(on_grad)

        return fwd

    return hook


def run_twin(cfg: LockstepConfig, out: str | Path) -> dict[str, Any]:
    """Run under torchrun with two processes; rank 0 writes ``out``; both return the summary."""
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise RuntimeError("the two-process lockstep needs exactly 2 ranks")
    blocks, base, gen = setup_run(cfg)

    gate_rows: list = []
    gate = Replica(copy.deepcopy(base), cfg.lr)
    for step in range(1, cfg.gate_steps + 1):
        gate.step(
            batch_inputs(blocks, step, cfg, cfg.seed),
            step,
            _level1_hooks(rank, None, step, gen, gate_rows),
        )
        gate.update()
    me = Replica(copy.deepcopy(base), cfg.lr)
    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    if cfg.level == 1:
        for step in range(1, cfg.steps + 1):
            me.step(
                batch_inputs(blocks, step, cfg, cfg.seed),
                step,
                _level1_hooks(rank, cfg.sdc, step, gen, rows),
            )
            me.update()
        totals = defaultdict(lambda: [0, 0, 0.0])
        for r in rows:
            t = totals[(r["submodule"], r["direction"])]
            t[0], t[1], t[2] = (
                t[0] + r["elements"],
                t[1] + r["mismatches"],
                t[2] + r["severity"] * r["mismatches"],
            )
        if rank == 1:
            mism, elements = sum(t[1] for t in totals.values()), sum(t[0] for t in totals.values())
            result = {
                "mismatch_frequency": mism / elements,
                "mismatch_severity": sum(t[2] for t in totals.values()) / max(mism, 1),
            }
    elif cfg.level == 2:
        nsr, cos = [], []
        for step in range(1, cfg.steps + 1):
            hook = corrupting(cfg.sdc, step, gen) if rank == 1 else None
            me.step(batch_inputs(blocks, step, cfg, cfg.seed), step, hook)
            g = me.grads()
            healthy = g.clone() if rank == 0 else torch.empty_like(g)
            dist.broadcast(healthy, src=0)
            if rank == 1:
                nsr.append(float((g - healthy).norm() / healthy.norm()))
                cos.append(float(torch.nn.functional.cosine_similarity(g, healthy, dim=0)))
                rows.append({"step": step, "gradient_nsr": nsr[-1], "cosine": cos[-1]})
                offset = 0
                for p in me.model.parameters():  # step with the healthy gradient: states stay equal
                    if p.grad is not None:
                        p.grad.copy_(healthy[offset : offset + p.numel()].view_as(p))
                        offset += p.numel()
            me.update()
        if rank == 1:
            result = {
                "worst_gradient_nsr": max(nsr),
                "mean_gradient_nsr": sum(nsr) / len(nsr),
                "min_cosine": min(cos),
            }
    else:
        control = Replica(copy.deepcopy(base), cfg.lr) if rank == 0 else None
        for step in range(1, cfg.steps + 1):
            hook = corrupting(cfg.sdc, step, gen) if rank == 1 else None
            loss = me.step(batch_inputs(blocks, step, cfg, cfg.seed), step, hook)
            me.update()
            if control is not None:
                control.step(batch_inputs(blocks, step, cfg, cfg.control_seed), step)
                control.update()
            rows.append({"step": step, "loss": loss})
        theirs = [p.detach().clone() for p in me.model.parameters()]
        for t in theirs:
            dist.broadcast(t, src=1)
        if rank == 0:
            mine = torch.cat([p.detach().reshape(-1) for p in me.model.parameters()])
            other = torch.cat([t.reshape(-1) for t in theirs])
            faulty = copy.deepcopy(me.model)
            for p, t in zip(faulty.parameters(), theirs, strict=True):
                p.data.copy_(t)
            held = batch_inputs(blocks, 10_000, cfg, cfg.seed + 99)
            ctrl = torch.cat([p.detach().reshape(-1) for p in control.model.parameters()])
            result = {
                "final_param_drift": float((other - mine).norm() / mine.norm()),
                "control_param_drift": float((ctrl - mine).norm() / mine.norm()),
                "prediction_divergence": prediction_divergence(faulty, me.model, held),
            }
    box = [{"result": result, "rows": rows, "gate": sum(r["mismatches"] for r in gate_rows)}]
    dist.broadcast_object_list(box, src=1)  # rank 1 holds the comparison
    faulty_side = box[0]
    summary = {"level": cfg.level, "mode": "two_ranks", "gate_mismatches": faulty_side["gate"]}
    summary["deterministic"] = summary["gate_mismatches"] == 0
    summary |= faulty_side["result"] if cfg.level != 3 else result
    if rank == 0:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / "steps.jsonl").open("w") as f:
            for r in faulty_side["rows"] if cfg.level != 3 else rows:
                f.write(json.dumps(r) + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    box = [summary]
    dist.broadcast_object_list(box, src=0)
    if owns:
        dist.barrier()  # both ranks done with gloo before either tears it down (a rank that
        dist.destroy_process_group()  # exits while the other still talks aborts in gloo)
    return box[0]


def in_twin_mode() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) == 2
