"""The ``demo`` command: the main job in four parts."""

from __future__ import annotations

import argparse

from attnchecker.models.families import FAMILIES

__all__ = ["add_parser"]


def _demo(args: argparse.Namespace) -> int:
    from attnchecker.demo import (
        run_diagnosis_demo,
        run_math_demo,
        run_model_demo,
        run_training_demo,
    )

    records = run_math_demo(seed=args.seed)
    failed = [r for r in records[:-1] if r["status"] == "missed"]
    model = run_model_demo(family=args.family, seed=args.seed, backend=args.backend)
    failed += [r for r in model if r["protected_grad_diff"] > 1e-5]
    found = run_diagnosis_demo(f"{args.out}/diagnosis", family=args.family)
    device, numerics = found["failing device"], found["unstable numerics"]
    if (
        [f["cause"] for f in device] != ["fault"] * 3
        or not numerics
        or any(f["cause"] != "numerics" for f in numerics)
    ):
        failed.append(found)
    if args.steps > 0:
        s = run_training_demo(args.out, family=args.family, steps=args.steps)
        failed += (
            [] if s["unprotected"]["non_trainable"] and not s["protected"]["non_trainable"] else [s]
        )
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """Add this group's commands to ``sub``."""
    demo = sub.add_parser(
        "demo", help="show extreme errors located and corrected", formatter_class=formatter,
        description="The main job, in four parts: the math core on one attention-shaped GEMM "
        "(every fault kind and pattern), a protected model under the same faults as an "
        "unprotected one, the diagnosis of a failing device beside an unstable run, and a "
        "training demo (reference, unprotected, checkpoint/restore and protected arms).",
        epilog="outputs: <out>/<arm>/ run directories (metrics.jsonl, events.jsonl, "
        "summary.json), <out>/report.html, <out>/diagnosis/\n"
        "example: attnchecker demo --family llama --steps 30",
    )  # fmt: skip
    demo.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    demo.add_argument("--family", default="gpt2", choices=FAMILIES)
    demo.add_argument(
        "--backend", default="eager", choices=["eager", "triton"],
        help="the model demo on the checked eager attention or the fused kernels (faults "
        "inside them; on a machine without CUDA in Triton's interpreter: slow)",
    )  # fmt: skip
    demo.add_argument("--out", default="runs/demo", help="where the training demo writes its runs")
    demo.add_argument("--steps", type=int, default=60, help="training demo steps (0: skip it)")
    demo.set_defaults(func=_demo)
