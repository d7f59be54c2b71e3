"""The ``demo`` command: the main job in four parts."""

from __future__ import annotations

import argparse

from attnchecker.cli.common import add_backend, add_command
from attnchecker.demo import BACKENDS
from attnchecker.models.families import FAMILIES

__all__ = ["TASK", "add_parser"]

TASK = ("see it work", "demo")


def _demo(args: argparse.Namespace) -> int:
    """The main job, in four parts: the math core on one attention-shaped GEMM (every fault kind
    and pattern), a protected model under the same faults as an unprotected one, the diagnosis
    of a failing device beside an unstable run, and a training demo (reference, unprotected,
    checkpoint/restore and protected arms).

    outputs: <out>/<arm>/ run directories (metrics.jsonl, events.jsonl, summary.json),
    <out>/report.html, <out>/diagnosis/

    example: attnchecker demo --family llama --steps 30
    """
    from attnchecker.demo import run_demo

    failed = run_demo(args.out, family=args.family, seed=args.seed, backend=args.backend,
                      steps=args.steps)  # fmt: skip
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add this group's commands to ``sub``."""
    demo = add_command(sub, "demo", _demo, "show extreme errors located and corrected")
    demo.add_argument("--seed", type=int, default=0, help="seed of the random operands")
    demo.add_argument("--family", default="gpt2", choices=FAMILIES)
    add_backend(
        demo,
        "the model demo on the checked eager attention or the fused kernels (faults inside "
        "them; on a machine without CUDA in Triton's interpreter: slow)",
        choices=BACKENDS,
    )
    demo.add_argument("--out", default="runs/demo", help="where the training demo writes its runs")
    demo.add_argument("--steps", type=int, default=60, help="training demo steps (0: skip it)")
