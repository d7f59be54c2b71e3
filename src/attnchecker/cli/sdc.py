"""The ``sdc`` commands: ``lockstep``, ``record`` and ``compare``."""

from __future__ import annotations

import argparse
import os

from attnchecker.cli.common import add_command, needs_torchrun, relaunch
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import SIZES

__all__ = ["TASK", "add_parser"]

TASK = ("silent corruption", "sdc")

_SDC = """Silent data corruption as the study of real faulty nodes measures it: lockstep (level 1:
every submodule's output, 2: every step's gradients, 3: a period of training against a control),
or record fingerprints on two machines and compare them.

example: attnchecker sdc record --out a.jsonl (on each machine), then attnchecker sdc compare
a.jsonl b.jsonl"""


def _sdc(args: argparse.Namespace) -> int:
    if needs_torchrun(args):
        return relaunch(args)
    import json

    from attnchecker.sdc import LockstepConfig, run_lockstep
    from attnchecker.sdc.twin import in_twin_mode, run_twin

    cfg = LockstepConfig(
        level=args.level, family=args.family, size=args.size, steps=args.steps, seed=args.seed,
        data=tuple(args.data) if args.data else None,
    )  # fmt: skip
    summary = run_twin(cfg, args.out) if in_twin_mode() else run_lockstep(cfg, args.out)
    if int(os.environ.get("RANK", "0")) == 0:
        from attnchecker.report.sdc import sdc_report

        report = sdc_report(args.out)
        shown = {k: v for k, v in summary.items() if k != "per_layer_drift"}
        if args.json:
            print(json.dumps(shown, indent=2))
        else:
            _table(f"SDC lockstep, level {args.level}: {args.out}", shown)
            print(f"report: {report}; every figure: {args.out}/summary.json")
    return 0 if summary["deterministic"] else 1


def _table(title: str, summary: dict) -> None:
    """A short human summary: each scalar figure on a row (nested ones counted)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for k, v in summary.items():
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, dict | list):
            v = f"{len(v)} entries (--json)"
        table.add_row(k.replace("_", " "), str(v))
    Console().print(table)


def _sdc_record(args: argparse.Namespace) -> int:
    from attnchecker.sdc import STUDY_NODE
    from attnchecker.sdc.fingerprint import record_run

    sdc = STUDY_NODE if args.faulty else None
    data = tuple(args.data) if args.data else None
    path = record_run(
        args.out, family=args.family, steps=args.steps, seed=args.seed, data=data, sdc=sdc
    )
    print(path)
    return 0


def _sdc_compare(args: argparse.Namespace) -> int:
    import json

    from attnchecker.sdc.fingerprint import compare

    result = compare(args.a, args.b)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0 if result["identical"] else 1
    from rich.console import Console
    from rich.table import Table

    console = Console()
    first = result["first_divergence"]
    if first is None:
        console.print(f"[bold]identical[/]: {result['compared']:,} fingerprints compared")
    else:
        console.print(
            f"[bold]first divergence[/]: step {first['step']}, {first['module']}, "
            f"{first['phase']} ({result['compared']:,} fingerprints compared, "
            f"{result['only_in_one']} in one recording only)"
        )
        table = Table("step", "max relative norm drift")
        for step, d in result["max_norm_drift_by_step"].items():
            table.add_row(str(step), f"{d:.3g}")
        console.print(table)
    nf = result["nonfinite"]
    if nf["a"] or nf["b"]:
        console.print(f"non-finite values: {nf['a']} in {args.a}, {nf['b']} in {args.b}")
    return 0 if result["identical"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add this group's commands to ``sub``."""
    summary = "SDC analysis: a healthy and a faulty replica in lockstep"
    sdc = add_command(sub, "sdc", None, summary, doc=_SDC)
    sdc_sub = sdc.add_subparsers(dest="sdc_command", required=True)
    lock = sdc_sub.add_parser("lockstep", help="level 1 (submodules), 2 (steps) or 3 (a period)")
    lock.add_argument("--level", type=int, choices=[1, 2, 3], default=1)
    lock.add_argument("--out", required=True)
    lock.add_argument("--family", default="llama", choices=FAMILIES)
    lock.add_argument("--size", default="tiny", choices=SIZES)
    lock.add_argument("--steps", type=int, default=20)
    lock.add_argument("--seed", type=int, default=0)
    lock.add_argument("--data", nargs="+", help="text files or folders (default: Shakespeare)")
    lock.add_argument(
        "--nproc", type=int, default=1, choices=[1, 2], help="2: healthy rank 0, faulty rank 1"
    )
    lock.add_argument("--json", action="store_true", help="print the summary as JSON")
    lock.set_defaults(func=_sdc)
    rec = sdc_sub.add_parser("record", help="record per-step fingerprints of a short training")
    rec.add_argument("--out", required=True, help="JSONL file")
    rec.add_argument("--family", default="llama", choices=FAMILIES)
    rec.add_argument("--steps", type=int, default=10)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--data", nargs="+")
    rec.add_argument("--faulty", action="store_true", help="run under the study-shaped SDC preset")
    rec.set_defaults(func=_sdc_record)
    cmp_ = sdc_sub.add_parser("compare", help="first divergence and drift of two recordings")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--json", action="store_true", help="the machine-readable document")
    cmp_.set_defaults(func=_sdc_compare)
