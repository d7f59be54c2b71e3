"""The default config's training step with its projections' checks (forward, and the backward's
dX and dW) as compiled regions (``check_impl="compiled"``, what ``"auto"`` picks where inductor
builds) against the same checks as eager ops (``"eager"``) and against the plain model with
transformers' SDPA attention.

Base width (hidden 768, 12 heads), 2 layers, B 8, L 128, causal LM, AdamW; the three copies of
one model are stepped alternately in one process (after warm-up steps that compile the regions),
overheads are medians of per-pair time ratios; fp32 and bf16 autocast. (Aten op counts are
not comparable here: under a dispatch mode a compiled region runs its eager ops.)

    python benchmarks/check_impl.py [--families gpt2 llama] [--dtypes fp32 bf16] [--reps 12]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics

import torch

from _common import alternate, command, environment, median_ms, parse, write
from attnchecker import ABFTConfig, protect_
from attnchecker.attention import regions
from attnchecker.models.tiny import build

ARMS = {"sdpa": None, "eager checks": "eager", "compiled checks": "compiled"}


def _step(model, inputs, dtype: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    )

    def step() -> None:
        with cast:
            loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def measure(family: str, dtype: str, args: argparse.Namespace) -> dict:
    base = build(family, args.size, layers=args.layers, max_len=args.length)
    base.config.use_cache = False
    base.train()
    ids = torch.randint(
        3, 128, (args.batch, args.length), generator=torch.Generator().manual_seed(0)
    )
    inputs = {"input_ids": ids, "labels": ids}
    steps = {}
    for arm, impl in ARMS.items():
        model = copy.deepcopy(base)
        if impl is None:
            model.set_attn_implementation("sdpa")
        else:
            protect_(model, ABFTConfig(check_impl=impl))
        steps[arm] = _step(model, inputs, dtype)
        steps[arm]()  # compiles the regions (compiled arm)
    times = alternate(steps, args.reps, warmup=2)
    ratio = {
        arm: statistics.median(a / b for a, b in zip(times[arm], times["sdpa"], strict=True)) - 1
        for arm in ARMS if arm != "sdpa"
    }  # fmt: skip
    return {
        "family": family, "dtype": dtype,
        "ms": {arm: median_ms(t) for arm, t in times.items()},
        "overhead": ratio, "regions": regions.describe(),
    }  # fmt: skip


def _markdown(rows: list[dict], env: dict, args: argparse.Namespace, cmd: str) -> str:
    out = [
        "# Projection checks as compiled regions vs eager ops, per training step",
        "",
        f"`{cmd}`; {args.size} width, {args.layers} layers, B {args.batch}, L {args.length}, "
        f"default config (forward and backward checks), {args.reps} alternated reps, medians. "
        f"torch {env['torch']}, {env['threads']} threads, load {env['loadavg_1min']:.2f}.",
        "",
        "| family | dtype | SDPA ms | eager checks ms | compiled checks ms | eager checks vs SDPA "
        "| compiled checks vs SDPA |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, ov = r["ms"], r["overhead"]
        out.append(
            f"| {r['family']} | {r['dtype']} | {ms['sdpa']:.0f} | {ms['eager checks']:.0f} | "
            f"{ms['compiled checks']:.0f} | {100 * ov['eager checks']:+.1f}% | "
            f"{100 * ov['compiled checks']:+.1f}% |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--dtypes", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--size", default="base")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--reps", type=int, default=12)
    args = parse(ap, {"size": "tiny", "reps": 3, "families": ["gpt2"], "dtypes": ["fp32"]})
    env = environment()
    rows = []
    for family in args.families:
        for dtype in args.dtypes:
            rows.append(measure(family, dtype, args))
            r = rows[-1]
            print(
                r["family"],
                r["dtype"],
                {k: f"{100 * v:+.1f}%" for k, v in r["overhead"].items()},
                flush=True,
            )
    path = write("check_impl", {"env": env, "rows": rows}, _markdown(rows, env, args, command()))
    print(path)


if __name__ == "__main__":
    main()
