"""The adaptive-protection commands of the CLI: ``bench``, ``plan`` and ``validate``.

The three-command flow: ``attnchecker campaign --out DIR ...`` (vulnerability),
``attnchecker bench --campaign DIR`` (cost on this machine), ``attnchecker plan --campaign DIR
--fault-rate R --budget B`` (the choice, as ``DIR/plan.json``; ``train --plan`` uses it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnchecker.errors import ConfigError
from attnchecker.models.tiny import SIZES

__all__ = ["add_parser", "write_profiles"]


def write_profiles(out: str | Path) -> list[Path]:
    """``vulnerability-<family>.json`` for every family of the campaign in ``out``."""
    from attnchecker.adaptive.profile import VulnerabilityProfile
    from attnchecker.inject.campaign import load_trials

    families = sorted({r["family"] for r in load_trials(Path(out))})
    return [
        VulnerabilityProfile.from_campaign(out, f).save(Path(out) / f"vulnerability-{f}.json")
        for f in families
    ]


def _family(args: argparse.Namespace) -> str:
    from attnchecker.inject.campaign import load_trials

    if getattr(args, "family", None):
        return args.family
    families = sorted({r["family"] for r in load_trials(Path(args.campaign))})
    if len(families) != 1:
        raise ConfigError(f"{args.campaign} holds families {families}: say which (--family)")
    return families[0]


def _bench(args: argparse.Namespace) -> int:
    from attnchecker.adaptive.bench import measure_costs

    setup = {"size": args.size, "batch": args.batch, "seq_len": args.seq_len}
    family = args.model
    if args.campaign:  # the campaign's model and batch shape
        meta = json.loads((Path(args.campaign) / "meta.json").read_text())["config"]
        setup = {k: meta[k] for k in setup}
        family = family or _family(args)
    if family is None:
        raise ConfigError("give --model FAMILY or --campaign DIR")
    from attnchecker.attention.config import ALL_OPS

    ops = tuple(args.ops or ALL_OPS)
    cost = measure_costs(family, **setup, compile=args.compile, dtype=args.dtype, reps=args.reps,
                         device=args.device, ops=ops, progress=True)  # fmt: skip
    where = args.out or (Path(args.campaign or ".") / f"cost-{family}.json")
    path = cost.save(where)
    print(f"plain step {1e3 * cost.step_seconds:.1f} ms; leaving SDPA for the checked engine "
          f"{cost.engine.point:+.1%}; per op, all {cost.setup['layers']} layers:")  # fmt: skip
    for o in cost.ops:
        print(f"  {o.op:<7} {o.cost.point:+7.1%} [{o.cost.low:+.1%}, {o.cost.high:+.1%}] "
              f"{o.launches:5d} ops launched")  # fmt: skip
    print(f"wrote {path}")
    return 0


def _profiles(args: argparse.Namespace):
    from attnchecker.adaptive.controller import FaultRate
    from attnchecker.adaptive.profile import CostProfile, VulnerabilityProfile

    family = _family(args)
    vuln = VulnerabilityProfile.from_campaign(args.campaign, family)
    vuln.save(Path(args.campaign) / f"vulnerability-{family}.json")
    if args.pool_layers:
        vuln = vuln.pooled()
    cost_path = Path(args.cost or Path(args.campaign) / f"cost-{family}.json")
    if not cost_path.exists():
        raise ConfigError(
            f"no cost profile at {cost_path}: run attnchecker bench --campaign {args.campaign}"
        )
    kinds = None
    if args.kinds:
        try:
            kinds = {k: float(p) for k, p in (kv.split("=") for kv in args.kinds.split(","))}
        except ValueError:
            raise ConfigError(f"--kinds is kind=probability,..., got {args.kinds!r}") from None
    return vuln, CostProfile.load(cost_path), FaultRate(args.fault_rate, args.per, kinds)


def _fraction(text: str) -> float:
    """'5%' or 0.05."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an overhead like 5% or 0.05, got {text!r}") from None


def _plan(args: argparse.Namespace) -> int:
    from attnchecker.adaptive.controller import choose

    vuln, cost, rate = _profiles(args)
    choice = choose(vuln, cost, rate, target=args.target, budget=args.budget,
                    confidence=args.confidence, estimate=args.estimate)  # fmt: skip
    out = Path(args.out or Path(args.campaign) / "plan.json")
    out.write_text(json.dumps({"rate": vars(rate), **choice.to_dict()}, indent=1))
    if args.json:
        print(json.dumps(choice.to_dict(), indent=1))
    else:
        print("\n".join(choice.lines(cost.step_seconds)))
        print(f"wrote {out} (attnchecker train --plan {out}; in Python: "
              f"ABFTConfig.from_dict(json.load(f)['config']))")  # fmt: skip
    return 0


def _validate(args: argparse.Namespace) -> int:
    from attnchecker.adaptive.simulate import frontier
    from attnchecker.report.adaptive import frontier_report, frontier_rows

    vuln, cost, rate = _profiles(args)
    sims = frontier(vuln, cost, rate, args.budgets, steps=args.steps, seed=args.seed,
                    timing_reps=args.timing_reps, progress=True)  # fmt: skip
    meta = {"family": vuln.family, "rate": f"{rate.value:g} faults per {rate.per}",
            "pooled_layers": args.pool_layers,
            "campaign": str(args.campaign), "cost": cost.setup}  # fmt: skip
    path = frontier_report(sims, args.out or Path(args.campaign) / "frontier", meta)
    print("\n".join(frontier_rows(sims)))
    print(f"wrote {path}")
    return 1 if any(s.verdict == "ABOVE" for s in sims) else 0


def _rate_args(p: argparse.ArgumentParser) -> None:
    from attnchecker.adaptive.controller import RATE_UNITS

    p.add_argument("--campaign", required=True, help="a campaign directory")
    p.add_argument("--family", help="the campaign's family (needed when it has several)")
    p.add_argument("--cost", help="cost profile (default: <campaign>/cost-<family>.json)")
    p.add_argument("--fault-rate", type=float, required=True, help="faults per --per")
    p.add_argument("--per", default="device-hour", choices=RATE_UNITS,
                   help="element-op: per multiply-add; step or device-hour: spread over the "
                   "step's GEMMs by their work")  # fmt: skip
    p.add_argument("--kinds", help="kind distribution, e.g. nan=0.5,inf=0.5 (default: uniform "
                   "over the campaign's kinds)")  # fmt: skip
    p.add_argument("--pool-layers", action="store_true",
                   help="one vulnerability per op from the trials of every layer (tighter "
                   "intervals from few trials; assumes the layers alike)")  # fmt: skip


def add_parser(sub, formatter) -> None:
    from attnchecker.models.families import FAMILIES

    b = sub.add_parser(
        "bench", help="cost profile: what each check costs on this machine",
        formatter_class=formatter,
        description="Step copies of one model alternately: the plain model (SDPA), protect_ "
        "checking nothing, and one arm per op; each op's cost is a fraction of the plain step "
        "(median, with its interval), with the ops it launches and each GEMM's size.",
        epilog="outputs: <campaign>/cost-<family>.json (or --out)\n"
        "example: attnchecker bench --campaign runs/camp",
    )  # fmt: skip
    b.add_argument("--model", choices=FAMILIES, help="family (default: the campaign's)")
    b.add_argument("--campaign", help="take the model and batch shape from this campaign")
    b.add_argument("--size", default="tiny", choices=SIZES)
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--seq-len", type=int, default=32)
    b.add_argument("--compile", action="store_true", help="time every arm under torch.compile")
    b.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    b.add_argument("--device", default="cpu")
    b.add_argument("--reps", type=int, default=15, help="rounds (every arm steps once each)")
    b.add_argument("--ops", nargs="+", help="only these ops (e.g. with --compile: an arm each)")
    b.add_argument("--out", help="cost profile file")
    b.set_defaults(func=_bench)

    p = sub.add_parser(
        "plan", help="choose what to check for a fault rate and a target or budget",
        formatter_class=formatter,
        description="From the campaign's vulnerability profile and the cost profile: the "
        "cheapest schedule (ops x layers, every step / every k steps / never) meeting a target "
        "of non-trainable events per million steps, or the safest within an overhead budget; "
        "prints it with the expected risk with and without it and the expected overhead.",
        epilog="outputs: <campaign>/plan.json (the ABFTConfig and the expectations)\n"
        "example: attnchecker plan --campaign runs/camp --fault-rate 1e-3 --budget 5%",
    )  # fmt: skip
    _rate_args(p)
    goal = p.add_mutually_exclusive_group(required=True)
    goal.add_argument("--target", type=float, help="non-trainable events per million steps")
    goal.add_argument("--budget", type=_fraction, help="overhead, e.g. 5%% or 0.05")
    p.add_argument("--confidence", type=float, default=0.95, choices=[0.8, 0.9, 0.95, 0.99])
    p.add_argument("--estimate", default="high", choices=["high", "point"],
                   help="which end of the risk intervals decides")  # fmt: skip
    p.add_argument("--out", help="plan file (default: <campaign>/plan.json)")
    p.add_argument("--json", action="store_true", help="print the choice as JSON")
    p.set_defaults(func=_plan)

    v = sub.add_parser(
        "validate", help="simulate training under faults: predicted vs measured frontier",
        formatter_class=formatter,
        description="For each budget, the controller's choice trains the campaign's model "
        "under faults sampled at the rate (make it high: events in minutes); the count of "
        "non-trainable steps and the measured overhead are set against the predicted "
        "intervals. Exit status 1 if a count is above its interval (more events than claimed).",
        epilog="outputs: <campaign>/frontier/frontier.{json,md,png}\n"
        "example: attnchecker validate --campaign runs/camp --fault-rate 1 --per step "
        "--budgets 0.5 1",
    )  # fmt: skip
    _rate_args(v)
    v.add_argument("--budgets", nargs="+", type=_fraction, required=True)
    v.add_argument("--steps", type=int, default=400, help="training steps per point")
    v.add_argument("--timing-reps", type=int, default=9)
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--out", help="report directory (default: <campaign>/frontier)")
    v.set_defaults(func=_validate)
