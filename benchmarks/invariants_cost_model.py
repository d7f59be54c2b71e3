"""What the checks beyond the GEMMs add to a training step at Llama-8B widths on an H200:
**modelled, not measured** (``attnchecker.gpu_cost``: no GPU has run them).

Both arms of each comparison are traced the same way (:func:`attnchecker.gpu_cost.traced_step`:
real tensors' shapes, nothing computed, every launching op and Triton launch recorded with its
bytes and grid): the corrected model (``ABFTConfig(backend="sdpa", check_impl="triton")``,
what ``auto`` runs on CUDA) with fused AdamW, then the same with ``invariants=("norm",)``,
``("update",)`` (the optimizer guarded by ``attnchecker.guard``: its flag and the update check)
and both. A step of 32 layers is extrapolated from traces of 1 and 2 layers (the second layer's
cost is a layer's; the rest, embeddings, the LM head, the final norm and their optimizer state,
is the first trace less one layer). One GPU, batch 1 x L 4,096, the full optimizer on it: the
update check's share of a step scales with the parameters a rank updates over the tokens it
computes, so under FSDP over N ranks with T tokens each it is (4,096 / (N T)) of the figure
here; the table gives it for 8 ranks x 8,192 tokens too.

What the model cannot see (``gpu_cost``'s list): the device constants are not calibrated; fp64
accumulation in the row-sums kernel is taken as memory-bound (an H200's fp64 rate is 1/30 of
its bf16 dense rate, ~2 FLOPs an element here: not a limit at 4.8 TB/s); a kernel's occupancy.

    python benchmarks/invariants_cost_model.py [--layers 32] [--quick]
"""

from __future__ import annotations

import argparse
import time
import warnings

from _common import command, environment, parse, write
from attnchecker import ABFTConfig
from attnchecker.gpu_cost import H200, traced_step

BASE = ABFTConfig(backend="sdpa", check_impl="triton")
ARMS = {
    "corrected": BASE,
    "+ norm": BASE.replace(invariants=("norm",)),
    "+ update": BASE.replace(invariants=("update",)),
    "+ norm + update": BASE.replace(invariants=("norm", "update")),
}


def trace(config, layers: int, L: int, widths) -> dict[str, float]:
    t = traced_step(config, layers=layers, L=L, fused=True, widths=widths)
    m = t.modelled(H200)
    return {"device": m.device, "host": m.host, "launches": m.launches, "syncs": m.syncs,
            "eager": m.step(), "graph": m.device}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--L", type=int, default=4096)
    args = parse(ap, {"L": 256})
    widths = {} if args.quick else None  # --quick: the base width (seconds, not a figure)
    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    rows = {}
    for name, config in ARMS.items():
        one, two = trace(config, 1, args.L, widths), trace(config, 2, args.L, widths)
        layer = {k: two[k] - one[k] for k in one}
        rest = {k: one[k] - layer[k] for k in one}
        rows[name] = {"layer": layer, "rest": rest,
                      "step": {k: rest[k] + args.layers * layer[k] for k in one}}  # fmt: skip
        print(name, {k: round(v * 1e3, 3) if isinstance(v, float) else v
                     for k, v in rows[name]["step"].items()}, flush=True)  # fmt: skip
    base = rows["corrected"]["step"]
    lines = [
        "# The checks beyond the GEMMs at Llama-8B widths: modelled on an H200, not measured",
        "",
        f"`{command()}`; {time.perf_counter() - t0:.0f} s of tracing. {args.layers} layers "
        f"extrapolated from 1 and 2, batch 1 x L {args.L}, bf16 autocast, fused AdamW on one "
        "GPU (module docstring: what scales, what the model cannot see).",
        "",
        "| arm | launches a step | device ms (graph) | eager ms | host reads | vs corrected, "
        "graph | vs corrected, eager | per layer, device us | the rest, device us |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        s = r["step"]
        lines.append(
            f"| {name} | {s['launches']:.0f} | {s['graph'] * 1e3:.2f} | {s['eager'] * 1e3:.2f} "
            f"| {s['syncs']:.0f} | {100 * (s['graph'] / base['graph'] - 1):+.2f}% | "
            f"{100 * (s['eager'] / base['eager'] - 1):+.2f}% | {r['layer']['device'] * 1e6:.0f} "
            f"| {r['rest']['device'] * 1e6:.0f} |"
        )
    upd = rows["+ update"]["step"]["graph"] - base["graph"]
    norm = rows["+ norm"]["step"]["graph"] - base["graph"]
    scaled = upd * args.L / (8 * 8192)
    lines += [
        "",
        f"The update check adds {upd * 1e3:.2f} ms of device time a step here ("
        f"{100 * upd / base['graph']:+.2f}%); under FSDP over 8 ranks of 8,192 tokens each a "
        f"rank updates 1/8 of the parameters for 2x the tokens: {scaled * 1e3:.3f} ms, "
        f"{100 * scaled / base['graph']:+.3f}% of the same step. The norms' check adds "
        f"{norm * 1e3:.2f} ms ({100 * norm / base['graph']:+.2f}%), per token, whatever the "
        f"sharding. Together, that job: **{100 * (scaled + norm) / base['graph']:+.2f}%** "
        "(modelled).",
    ]
    write("invariants_cost_model", {"rows": rows, "args": vars(args), "env": environment()},
          "\n".join(lines) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
