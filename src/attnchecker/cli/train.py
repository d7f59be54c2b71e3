"""The ``train`` command."""

from __future__ import annotations

import argparse
import sys

from attnchecker.attention.config import INVARIANTS, POLICIES, SCOPES
from attnchecker.cli.common import add_backend, add_command, needs_torchrun, relaunch
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import SIZES
from attnchecker.train.loop import RECOVERIES, TASKS

__all__ = ["TASK", "add_parser"]

TASK = ("train", "train (protected or not, under faults, with recovery)")


def _train(args: argparse.Namespace) -> int:
    """Train a family preset (--size tiny: hidden 32, 2 layers; small: 256, 4 layers; base: 768,
    12 heads) or your own transformers config (--model) on Shakespeare or your texts, optionally
    protected (--protect), under a fault plan or sampled faults, with checkpoint/restore
    (--recovery checkpoint), on N processes (--nproc: DDP through torchrun). Every step is
    diagnosed (your hardware / not).

    outputs: <out>/meta.json, metrics.jsonl (a line per step), events.jsonl (faults, protection
    events, diagnoses, rollbacks), model.safetensors, summary.json (every rank's counts, the
    outlier rank, the devices named quarantine candidates); rank r > 0 under <out>/rank<r>/; a
    device whose checks fire at two steps or more (or again in a replay) is named on stderr at
    exit, with the command that reproduces it

    example: attnchecker train --out runs/t --family llama --protect --fault-rate 0.1
    """
    if needs_torchrun(args):
        return relaunch(args)
    import json
    from pathlib import Path

    from attnchecker.adaptive.controller import load_plan
    from attnchecker.attention.config import ABFTConfig
    from attnchecker.inject import FaultPlan
    from attnchecker.train.loop import TrainConfig, sampled_faults, train

    abft = None
    if args.plan:  # attnchecker plan's choice
        # a plan pins the engine it was priced for ("auto", the default, asks for none)
        backend = None if args.backend == "auto" else args.backend
        abft = load_plan(args.plan, backend=backend).replace(policy=args.policy)
        abft = abft.replace(invariants=tuple(args.invariants)) if args.invariants else abft
    elif args.protect:
        abft = ABFTConfig(policy=args.policy, backend=args.backend, scope=args.scope,
                          invariants=tuple(args.invariants))  # fmt: skip
    if args.faults:
        faults = FaultPlan.from_json(Path(args.faults).read_text())
    else:
        faults = sampled_faults(args.fault_rate, args.steps, args.seed)
    cfg = TrainConfig(
        family=args.family, model=args.model, size=args.size, task=args.task, steps=args.steps,
        batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed, abft=abft,
        protect=abft is not None, recovery=args.recovery, fault_rank=args.fault_rank,
        checkpoint_every=args.checkpoint_every, bf16=args.bf16, warmup=args.warmup,
        data=tuple(args.data) if args.data else None, policy=args.policy, compile=args.compile,
    )  # fmt: skip
    summary = train(cfg, args.out, faults=faults)
    print(json.dumps(summary, indent=2))
    for q in summary["quarantine"]:  # the exit message: a device to take out of service
        print(_quarantine(q, args.argv), file=sys.stderr)
    return 0


def _quarantine(evidence: dict, argv: list[str]) -> str:
    """A device named a quarantine candidate (:mod:`attnchecker.recovery.ledger`), with the
    command that reproduces it: this run again, pinned to that device (the same seed and
    batches), and the steps its checks fired at."""
    import shlex

    pin = "" if evidence["index"] is None else f"CUDA_VISIBLE_DEVICES={evidence['index']} "
    command = f"{pin}attnchecker {shlex.join(argv)}"
    return (
        f"attnchecker: {evidence['message']}. Reproduce on host {evidence['host']}: {command} "
        f"(checks fire again at steps {', '.join(map(str, evidence['steps'][:8]))}; on another "
        f"device they should not)"
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add this group's commands to ``sub``."""
    tr = add_command(sub, "train", _train, "train a model, optionally protected, under faults")
    tr.add_argument("--out", required=True, help="run directory")
    tr.add_argument("--family", default="gpt2", choices=FAMILIES)
    tr.add_argument(
        "--model",
        metavar="FACTORY_OR_CONFIG",
        help="your own model: package.module:function (called with vocab_size= and seq_len=, "
        "returning a model from token ids to logits, or (model, loss)), or a transformers "
        "config.json or a directory with one (randomly initialised, nothing downloaded); used "
        "instead of --family/--size",
    )
    tr.add_argument("--size", default="tiny", choices=SIZES)
    tr.add_argument("--task", default="lm", choices=TASKS)
    tr.add_argument("--steps", type=int, default=50)
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--seq-len", type=int, default=64)
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--protect", action="store_true", help="protect_ the model")
    tr.add_argument("--plan", help="protect with attnchecker plan's choice (its plan.json)")
    tr.add_argument(
        "--policy", default="warn", choices=POLICIES,
        help="a step with an uncorrectable error (and under skip_step / replay one with a "
        "non-finite loss or gradient, protected or not): warn, raise, skip its update, or "
        "replay it on its batch and random state first (skipped if the replay goes wrong too)",
    )  # fmt: skip
    tr.add_argument("--compile", action="store_true", help="torch.compile the model")
    add_backend(
        tr,
        "protected attention: the SDPA route on CUDA and the checked eager math "
        "elsewhere (auto), or one of them, or the fused kernels (triton)",
    )
    tr.add_argument("--recovery", default="none", choices=RECOVERIES)
    tr.add_argument("--checkpoint-every", type=int, default=10)
    tr.add_argument("--warmup", type=int, default=0, help="linear learning-rate warmup steps")
    tr.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    tr.add_argument("--data", nargs="+", help="text files or folders (default: Shakespeare)")
    tr.add_argument("--faults", help="a fault plan as JSON (FaultPlan.to_json)")
    tr.add_argument("--fault-rate", type=float, default=0.0, help="faults per step, sampled")
    tr.add_argument("--nproc", type=int, default=1, help="processes: DDP through torchrun")
    tr.add_argument("--fault-rank", type=int, default=0, help="the rank the faults hit")
    tr.add_argument(
        "--invariants", nargs="+", default=[], choices=INVARIANTS, metavar="CHECK",
        help="with --protect or --plan, checks beyond the GEMMs: norm (every RMSNorm / "
        "LayerNorm output), update (the optimizer's update: AdamW's moments and parameters)",
    )  # fmt: skip
    tr.add_argument(
        "--scope", default="attention", choices=SCOPES,
        help="what --protect checks: the attention modules, or every linear layer too",
    )  # fmt: skip
