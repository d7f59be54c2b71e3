"""What a fault costs with checkpoint/restore and with protection, per family, on this machine.

Base width (hidden 768, 12 heads, 2 layers, batch 8, L = 128, fp32, causal or masked LM, AdamW).
Measured: the step time plain and protected (alternated, medians), and the checkpoint save and
load time of model + AdamW state through ``CheckpointManager`` (safetensors, hashed, fsync-free).
Derived: save + load in training steps, and the time lost per fault with checkpoint intervals
k = 100 and 500 steps (load + on average k / 2 replayed steps + the steps' share of saving),
against protection's cost (its per-step overhead; a fault costs nothing more).

    python benchmarks/recovery_cost.py [--families bert gpt2 llama] [--reps 6] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from _common import alternate, environment, median_ms, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.attention.config import OPS
from attnchecker.models.families import FAMILIES, TABLE
from attnchecker.models.tiny import build
from attnchecker.recovery import CheckpointManager

WIDTH = {
    "tiny": "hidden 32, 4 heads",
    "small": "hidden 256, 4 heads",
    "base": "hidden 768, 12 heads",
}


def measure(family: str, reps: int, size: str = "base", n_saves: int = 3) -> dict[str, object]:
    plain = build(family, size, layers=2, max_len=128)
    plain.config.use_cache = False
    plain.train()
    forward = copy.deepcopy(plain)
    protect_(forward, ABFTConfig(ops=OPS))  # ATTNChecker's coverage: the forward alone
    protected = copy.deepcopy(plain)
    protect_(protected)  # forward and backward
    if TABLE[family].sdpa:  # the plain model as users run it
        plain.set_attn_implementation("sdpa")
    ids = torch.randint(3, 128, (8, 128), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    opts = {}

    def stepper(name, model):
        opts[name] = opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step() -> None:
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    t = alternate(
        {
            "plain": stepper("plain", plain),
            "forward": stepper("forward", forward),
            "protected": stepper("protected", protected),
        },
        reps,
        warmup=1,
    )
    ratio = statistics.median(p / q for p, q in zip(t["protected"], t["plain"], strict=True))
    fwd = statistics.median(p / q for p, q in zip(t["forward"], t["plain"], strict=True))
    step_s = median_ms(t["plain"]) / 1e3
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as d:
        mgr = CheckpointManager(d, every=1, keep=1)
        for i in range(n_saves):
            t0 = time.perf_counter()
            mgr.save(i + 1, plain, opts["plain"])
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.restore(plain, opts["plain"])
            loads.append(time.perf_counter() - t0)
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    row = {
        "family": family,
        "params_m": sum(p.numel() for p in plain.parameters()) / 1e6,
        "step_ms": 1e3 * step_s,
        "protected_step_ms": median_ms(t["protected"]),
        "protection_overhead": ratio - 1,
        "forward_only_overhead": fwd - 1,
        "save_s": save_s,
        "load_s": load_s,
        "save_load_steps": (save_s + load_s) / step_s,
    }
    for k in (100, 500):
        row[f"lost_steps_per_fault_k{k}"] = (
            load_s / step_s + k / 2
        )  # load, then replay half an interval
        row[f"save_overhead_k{k}"] = save_s / step_s / k  # fraction of every step spent saving
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["bert", "gpt2", "llama"], choices=FAMILIES)
    ap.add_argument("--reps", type=int, default=6, help="alternated step triples")
    ap.add_argument("--saves", type=int, default=3, help="timed checkpoint saves and loads")
    ap.add_argument("--size", default="base", choices=["tiny", "small", "base"],
                    help="model width (attnchecker.models.tiny: hidden 32 / 256 / 768)")  # fmt: skip
    args = parse(ap, quick={"families": ["gpt2"], "reps": 1, "saves": 1, "size": "tiny"})
    env = environment()
    rows = []
    for fam in args.families:
        r = measure(fam, args.reps, args.size, args.saves)
        rows.append(r)
        print(
            f"{fam:8s} step {r['step_ms']:.0f} ms (protected {100 * r['protection_overhead']:+.1f}%), save {r['save_s']:.2f} s, "
            f"load {r['load_s']:.2f} s = {r['save_load_steps']:.1f} steps; lost per fault {r['lost_steps_per_fault_k100']:.0f} / "
            f"{r['lost_steps_per_fault_k500']:.0f} steps (k = 100 / 500)"
        )
    lines = [
        "# Recovery cost: checkpoint/restore against protection",
        "",
        f"`python benchmarks/recovery_cost.py --families {' '.join(args.families)} --reps {args.reps} --saves {args.saves} "
        f"--size {args.size}`; torch {env['torch']}, {env['threads']} threads, {env['date']}. "
        f"{args.size.capitalize()} width ({WIDTH[args.size]}), 2 layers, batch 8, L = 128, fp32, AdamW. Checkpoint = model + AdamW state "
        "(safetensors + SHA-256), local disk. Lost per fault = load + k/2 replayed steps (a fault lands on average half an "
        "interval after the last checkpoint); saving also costs save/k of every step. Protection repairs the fault inside the "
        "step: its cost is the per-step overhead, paid whether or not a fault happens. Step time and overheads against "
        "the plain model with its default SDPA attention (GPT-Neo: eager).",
        "",
        "A fault in a **backward** GEMM (dQ, dK, dV, dP, a projection's dX or dW): with the forward's checks alone "
        "(ATTNChecker's coverage) it reaches the gradients unseen, so it costs what it costs unprotected (a rollback: "
        "the lost-steps columns); with the backward checks (the default) it is repaired in the step, no step lost, for "
        "the last column's overhead (`tests/integration/test_protect_backward.py`: every family, every backward GEMM).",
        "",
        "| family | params (M) | step ms | save s | load s | save+load in steps | lost steps/fault k=100 | k=500 | saving overhead k=100 | k=500 | forward-only protection `ABFTConfig(ops=OPS)` | protection (fwd + bwd) `ABFTConfig()` |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['params_m']:.0f} | {r['step_ms']:.0f} | {r['save_s']:.2f} | {r['load_s']:.2f} | "
            f"{r['save_load_steps']:.1f} | {r['lost_steps_per_fault_k100']:.0f} | {r['lost_steps_per_fault_k500']:.0f} | "
            f"{100 * r['save_overhead_k100']:.2f}% | {100 * r['save_overhead_k500']:.2f}% | "
            f"{100 * r['forward_only_overhead']:+.1f}% | {100 * r['protection_overhead']:+.1f}% |"
        )
    payload = {"environment": env, "args": vars(args), "rows": rows}
    write("recovery_cost", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
