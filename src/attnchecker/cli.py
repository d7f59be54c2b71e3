"""Command line: ``attnchecker <command>``. Thin: parse, build one config, call the library."""

from __future__ import annotations

import argparse
import os
import sys

from attnchecker.attention.config import BACKENDS, POLICIES, SCOPES
from attnchecker.errors import AttnCheckerError
from attnchecker.inject.kinds import DEFAULT_KINDS
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import SIZES

__all__ = ["main"]


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


def _campaign(args: argparse.Namespace) -> int:
    from attnchecker.inject.campaign import CampaignConfig, run_campaign
    from attnchecker.report import campaign_report

    def split(
        values: list[str],
    ) -> tuple[str, ...]:  # "a,b c" -> (a, b, c); "-inf" needs a comma list
        return tuple(v for arg in values for v in arg.split(",") if v)

    cfg = CampaignConfig(
        families=split(args.families), sites=split(args.sites), kinds=split(args.kinds),
        patterns=split(args.patterns), trials=args.trials, steps=args.steps, layer=args.layer,
        layers=tuple(args.layers) if args.layers else None,
        size=args.size, seed=args.seed, workers=args.workers, backend=args.backend,
        rank=int(os.environ.get("RANK", 0)) if args.rank is None else args.rank,
        world=int(os.environ.get("WORLD_SIZE", 1)) if args.world is None else args.world,
    )  # fmt: skip
    from attnchecker.cli_adaptive import write_profiles

    summary = run_campaign(cfg, args.out)
    profiles = ", ".join(p.name for p in write_profiles(args.out))
    print(f"{summary['trials']} trials in {args.out}; report: {campaign_report(args.out)}; "
          f"vulnerability profiles: {profiles}")  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnchecker.report import campaign_report
    from attnchecker.report.training import demo_report, run_report

    out = Path(args.out)
    if any(out.glob("trials*.jsonl")):
        print(campaign_report(out))
    elif (out / "summary.json").exists() and (out / "reference").is_dir():
        print(demo_report(out))
    elif (out / "frontier.json").exists():
        from attnchecker.report.adaptive import rebuild_frontier

        print(rebuild_frontier(out))
    elif (out / "metrics.jsonl").exists():
        print(run_report(out))
    elif (out / "steps.jsonl").exists() and (out / "summary.json").exists():
        from attnchecker.report.sdc import sdc_report

        print(sdc_report(out))
    else:
        print(f"{out}: not a campaign, demo or training run directory", file=sys.stderr)
        return 2
    return 0


def _relaunch(args: argparse.Namespace) -> int:
    """Run this same command under torchrun with ``--nproc`` processes (gloo on CPU)."""
    import subprocess

    argv = list(args.argv)
    i = argv.index("--nproc")
    del argv[i : i + 2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(args.nproc), "-m", "attnchecker.cli", *argv]
    return subprocess.call(cmd)


def _train(args: argparse.Namespace) -> int:
    import json

    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _relaunch(args)
    from pathlib import Path

    from attnchecker.attention.config import ABFTConfig
    from attnchecker.inject import FaultPlan
    from attnchecker.train.loop import TrainConfig, train

    faults = None
    abft = None
    if args.plan:  # attnchecker plan's choice
        abft = ABFTConfig.from_dict(json.loads(Path(args.plan).read_text())["config"])
        abft = abft.replace(policy=args.policy, backend=args.backend)
    if args.faults:
        faults = FaultPlan.from_json(Path(args.faults).read_text())
    elif args.fault_rate > 0:
        n = max(1, round(args.fault_rate * args.steps))
        kinds = DEFAULT_KINDS
        faults = FaultPlan.sample(n, args.seed, kinds=kinds, steps=tuple(range(1, args.steps + 1)))
    cfg = TrainConfig(
        family=args.family, model=args.model, size=args.size, task=args.task, steps=args.steps,
        batch=args.batch, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
        abft=abft or (
            ABFTConfig(policy=args.policy, backend=args.backend, scope=args.scope)
            if args.protect else None
        ),
        recovery=args.recovery, fault_rank=args.fault_rank, protect=args.protect or bool(abft),
        checkpoint_every=args.checkpoint_every, bf16=args.bf16, warmup=args.warmup,
        data=tuple(args.data) if args.data else None,
    )  # fmt: skip
    summary = train(cfg, args.out, faults=faults)
    print(json.dumps(summary, indent=2))
    return 0


def _sdc(args: argparse.Namespace) -> int:
    import json

    from attnchecker.sdc import LockstepConfig, run_lockstep
    from attnchecker.sdc.twin import in_twin_mode, run_twin

    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return _relaunch(args)
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


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown; description and epilog wrapped line by line (their line breaks kept)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import textwrap

        return "\n".join(
            textwrap.fill(line, width, initial_indent=indent, subsequent_indent=indent + "  ")
            for line in text.splitlines()
        )


_DESCRIPTION = """\
attnchecker keeps transformer training correct when the hardware computes wrong
numbers: checksums that find and correct INF / NaN / near-INF errors in attention's
GEMMs (forward and backward), fault injection to measure what errors do, SDC
analysis and recovery."""
_BY_TASK = """commands by task:
  see it work          demo
  train                train (protected or not, under faults, with recovery)
  measure errors       campaign, report
  choose what to check bench, plan, validate
  silent corruption    sdc
"""


def _parser() -> argparse.ArgumentParser:
    from attnchecker import __version__

    p = argparse.ArgumentParser(
        prog="attnchecker", description=_DESCRIPTION, epilog=_BY_TASK,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"attnchecker {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="show extreme errors located and corrected", formatter_class=_Help,
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

    from attnchecker.attention.config import OPS

    camp = sub.add_parser(
        "campaign", help="fault-injection campaign: trials, rates, report", formatter_class=_Help,
        description="For every family x site x kind x pattern, seeded trials train a short run "
        "twice under the same fault, unprotected and protected, and record how the error "
        "propagated and whether training survived. Sizes: tiny (hidden 32), small (256), "
        "base (768). Interrupted campaigns resume from their trials file.",
        epilog="outputs: <out>/trials.jsonl (one line per trial), summary.json (rates per "
        "cell), meta.json, report.html, vulnerability-<family>.json (for attnchecker plan)\n"
        "example: attnchecker campaign --out runs/camp --families gpt2 llama --trials 4",
    )  # fmt: skip
    camp.add_argument("--out", required=True, help="run directory (resumes if it has trials)")
    from attnchecker.inject.campaign import CampaignConfig

    camp.add_argument(
        "--families",
        nargs="+",
        default=list(CampaignConfig.families),
        help=f"model types of the family table (default: ATTNChecker's four); any of "
        f"{', '.join(FAMILIES)}",
    )
    camp.add_argument("--sites", nargs="+", default=list(OPS))
    camp.add_argument(
        "--kinds",
        nargs="+",
        default=list(DEFAULT_KINDS),
        help="fault kinds; give -inf inside a comma list, e.g. --kinds inf,-inf,nan",
    )
    camp.add_argument("--patterns", nargs="+", default=["0D"])
    camp.add_argument("--trials", type=int, default=1, help="trials per combination")
    camp.add_argument("--steps", type=int, default=3, help="training steps per run")
    camp.add_argument("--layer", type=int, default=0)
    camp.add_argument("--layers", type=int, nargs="+", help="faulty layers (instead of --layer)")
    camp.add_argument(
        "--backend", default="eager", choices=BACKENDS,
        help="attention backend of both arms; triton adds the sites kernel:s .. kernel:dq",
    )  # fmt: skip
    camp.add_argument("--size", default="tiny", choices=SIZES)
    camp.add_argument("--seed", type=int, default=0)
    camp.add_argument("--workers", type=int, default=1, help="processes")
    camp.add_argument(
        "--rank", type=int, default=None, help="this shard (default: $RANK, torchrun)"
    )
    camp.add_argument("--world", type=int, default=None, help="shards (default: $WORLD_SIZE)")
    camp.set_defaults(func=_campaign)
    tr = sub.add_parser(
        "train", help="train a model, optionally protected, under faults", formatter_class=_Help,
        description="Train a family preset (--size tiny: hidden 32, 2 layers; small: 256, 4 "
        "layers; base: 768, 12 heads) or your own transformers config (--model) on "
        "Shakespeare or your texts, optionally protected (--protect), under a fault plan or "
        "sampled faults, with checkpoint/restore (--recovery checkpoint), on N processes "
        "(--nproc: DDP through torchrun). Every step is diagnosed (your hardware / not).",
        epilog="outputs: <out>/meta.json, metrics.jsonl (a line per step), events.jsonl "
        "(faults, protection events, diagnoses, rollbacks), model.safetensors, summary.json "
        "(every rank's counts, the outlier rank); rank r > 0 under <out>/rank<r>/\n"
        "example: attnchecker train --out runs/t --family llama --protect --fault-rate 0.1",
    )  # fmt: skip
    tr.add_argument("--out", required=True, help="run directory")
    tr.add_argument("--family", default="gpt2", choices=FAMILIES)
    tr.add_argument(
        "--model",
        metavar="CONFIG_OR_DIR",
        help="your own model: a transformers config.json or a directory with one (randomly "
        "initialised, nothing downloaded); used instead of --family/--size",
    )
    tr.add_argument("--size", default="tiny", choices=SIZES)
    tr.add_argument("--task", default="lm", choices=["lm", "cls"])
    tr.add_argument("--steps", type=int, default=50)
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--seq-len", type=int, default=64)
    tr.add_argument("--lr", type=float, default=3e-4)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--protect", action="store_true", help="protect_ the model")
    tr.add_argument("--plan", help="protect with attnchecker plan's choice (its plan.json)")
    tr.add_argument("--policy", default="warn", choices=POLICIES)
    tr.add_argument(
        "--backend", default="eager", choices=BACKENDS,
        help="protected attention: the checked eager math, or the fused kernels (triton)",
    )  # fmt: skip
    tr.add_argument("--recovery", default="none", choices=["none", "checkpoint"])
    tr.add_argument("--checkpoint-every", type=int, default=10)
    tr.add_argument("--warmup", type=int, default=0, help="linear learning-rate warmup steps")
    tr.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    tr.add_argument("--data", nargs="+", help="text files or folders (default: Shakespeare)")
    tr.add_argument("--faults", help="a fault plan as JSON (FaultPlan.to_json)")
    tr.add_argument("--fault-rate", type=float, default=0.0, help="faults per step, sampled")
    tr.add_argument("--nproc", type=int, default=1, help="processes: DDP through torchrun")
    tr.add_argument("--fault-rank", type=int, default=0, help="the rank the faults hit")
    tr.add_argument(
        "--scope", default="attention", choices=SCOPES,
        help="what --protect checks: the attention modules, or every linear layer too",
    )  # fmt: skip
    tr.set_defaults(func=_train)
    sdc = sub.add_parser(
        "sdc", help="SDC analysis: a healthy and a faulty replica in lockstep",
        formatter_class=_Help,
        description="Silent data corruption as the study of real faulty nodes measures it: "
        "lockstep (level 1: every submodule's output, 2: every step's gradients, 3: a "
        "period of training against a control), or record fingerprints on two machines and "
        "compare them.",
        epilog="example: attnchecker sdc record --out a.jsonl (on each machine), then "
        "attnchecker sdc compare a.jsonl b.jsonl",
    )  # fmt: skip
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
    rep = sub.add_parser(
        "report", help="rebuild a campaign's, demo's or run's report from files",
        formatter_class=_Help,
        epilog="example: attnchecker report runs/camp (writes runs/camp/report.html)",
    )  # fmt: skip
    rep.add_argument("out")
    rep.set_defaults(func=_report)
    from attnchecker.cli_adaptive import add_commands

    add_commands(sub, _Help)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command; bad input (a library error, a missing or malformed file, a bad value) is
    one line on stderr and exit status 2, without a traceback unless ``--debug``."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "backend", "eager") != "eager":
            _kernels_here(args.backend)
        return int(args.func(args))
    except KeyboardInterrupt:
        print("attnchecker: interrupted", file=sys.stderr)
        return 130
    except (AttnCheckerError, OSError, ValueError) as e:
        if args.debug:
            raise
        print(f"attnchecker: error: {_say(e)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def _say(e: BaseException) -> str:
    """One line about a bad input."""
    import json

    if isinstance(e, FileNotFoundError):
        return f"no such file or directory: {e.filename}"
    if isinstance(e, IsADirectoryError):
        return f"a directory where a file was expected: {e.filename}"
    if isinstance(e, PermissionError):
        return f"permission denied: {e.filename}"
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _kernels_here(backend: str) -> None:
    """The fused kernels without CUDA run in Triton's interpreter, which must be chosen before
    the kernels are first imported; say so (it is slow: for trying things out and tests)."""
    import torch

    if (
        backend == "triton"
        and not torch.cuda.is_available()
        and "TRITON_INTERPRET" not in os.environ
    ):
        os.environ["TRITON_INTERPRET"] = "1"
        print("attnchecker: no CUDA device: the fused kernels run in Triton's interpreter (slow)")


if __name__ == "__main__":
    sys.exit(main())
