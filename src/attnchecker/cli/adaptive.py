"""The adaptive-protection commands of the CLI: ``bench``, ``plan`` and ``validate``.

The three-command flow: ``attnchecker campaign --out DIR ...`` (vulnerability),
``attnchecker bench --campaign DIR`` (cost on this machine), ``attnchecker plan --campaign DIR
--fault-rate R --budget B`` (the choice, as ``DIR/plan.json``; ``train --plan`` uses it).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from attnchecker.adaptive.bench import DTYPES
from attnchecker.adaptive.controller import ESTIMATES, RATE_UNITS
from attnchecker.adaptive.profile import CONFIDENCES
from attnchecker.cli.common import add_command
from attnchecker.errors import ConfigError
from attnchecker.models.tiny import SIZES

__all__ = ["TASK", "add_parser"]

TASK = ("choose what to check", "bench, plan, validate")


def _bench(args: argparse.Namespace) -> int:
    """Step copies of one model alternately: the plain model (SDPA), protect_ checking nothing,
    and one arm per op; each op's cost is a fraction of the plain step (median, with its
    interval), with the ops it launches and each GEMM's size. The linear layers' checks a
    campaign faulted (linear:mlp.c_fc:y) are priced too, each in every block that has it.

    outputs: <campaign>/cost-<family>.json (or --out)

    example: attnchecker bench --campaign runs/camp
    """
    from attnchecker.adaptive.bench import measure_costs
    from attnchecker.adaptive.profile import (
        VulnerabilityProfile,
        campaign_family,
        campaign_setup,
        cost_path,
        vulnerability_path,
    )
    from attnchecker.attention.config import ALL_OPS
    from attnchecker.attention.ops import linear_parts

    setup = {"size": args.size, "batch": args.batch, "seq_len": args.seq_len}
    family, ops = args.model, tuple(args.ops or ALL_OPS)
    if args.campaign:  # the campaign's model and batch shape, and the linear layers it faulted
        setup = campaign_setup(args.campaign)
        family = family or campaign_family(args.campaign)
        path = vulnerability_path(args.campaign, family)
        faulted = VulnerabilityProfile.load(path).ops if path.exists() and not args.ops else ()
        ops += tuple(op for op in faulted if linear_parts(op))
    if family is None:
        raise ConfigError("give --model FAMILY or --campaign DIR")
    cost = measure_costs(family, **setup, compile=args.compile, dtype=args.dtype, reps=args.reps,
                         device=args.device, ops=ops, progress=True)  # fmt: skip
    path = cost.save(args.out or cost_path(args.campaign or ".", family))
    print("\n".join(cost.lines()))
    print(f"wrote {path}")
    return 0


def _profiles(args: argparse.Namespace):
    """The vulnerability and cost profiles, and the fault rate, that ``plan`` and ``validate``
    decide from (``--preset``: a quoted rate per device, with its devices)."""
    from attnchecker.adaptive.controller import FaultRate, parse_kinds
    from attnchecker.adaptive.price import PRESETS
    from attnchecker.adaptive.profile import load_profiles

    vuln, cost = load_profiles(args.campaign, args.family, cost=args.cost, pooled=args.pool_layers)
    preset = getattr(args, "preset", None)
    if preset is not None:
        quoted, devices, _ = PRESETS[preset]
        args.devices = args.devices or devices
        return vuln, cost, FaultRate(quoted.value, quoted.per, parse_kinds(args.kinds))
    if args.fault_rate is None:
        raise ConfigError("give --fault-rate (with --per) or --preset")
    return vuln, cost, FaultRate(args.fault_rate, args.per, parse_kinds(args.kinds))


def _fraction(text: str) -> float:
    """'5%' or 0.05."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an overhead like 5% or 0.05, got {text!r}") from None


def _plan(args: argparse.Namespace) -> int:
    """What to run at a fault rate, priced in training time: with a campaign run with
    --recovery-arms, every option (no protection; the finite-gradient guard skipping or
    replaying a step that went wrong; ABFT correcting in place, skipping or replaying what it
    cannot correct) with its overhead, the outcomes of a fault and the steps it is expected to
    lose per day, the cheapest in a sentence with the fault rates at which the next option
    becomes cheaper. With --target or --budget, also the controller's schedule (ops x layers,
    every step / every k steps / never) meeting a target of non-trainable events per million
    steps, or the safest within an overhead budget, with the expected risk with and without it
    and the expected overhead. With --verify, the budget's choice is trained on this machine and
    timed against the plain model, and a cheaper one is chosen until the measured overhead fits
    (the cost model's per-op costs do not add exactly).

    outputs: <campaign>/pricing.json (the options), <campaign>/plan.json (a schedule: the
    ABFTConfig and the expectations)

    example: attnchecker plan --campaign runs/camp --preset llama3 --step-seconds 4
    """
    import json

    from attnchecker.adaptive.controller import choose, fit_measured, save_plan
    from attnchecker.adaptive.simulate import overhead

    vuln, cost, rate = _profiles(args)
    if args.target is None and args.budget is None:
        if _pricing(args, cost, rate) is None:
            raise ConfigError(
                "give --target or --budget for a schedule; pricing the options needs a campaign "
                "run with --recovery-arms"
            )
        return 0
    kw = {"confidence": args.confidence, "estimate": args.estimate}
    if args.verify:
        if args.budget is None:
            raise ConfigError("--verify measures a budget's choice: give --budget")
        choice = fit_measured(vuln, cost, rate, args.budget,
                              lambda c: overhead(vuln, c, reps=args.timing_reps, seed=0),
                              **kw)  # fmt: skip
    else:
        choice = choose(vuln, cost, rate, target=args.target, budget=args.budget, **kw)
    out = save_plan(choice, rate, args.out or Path(args.campaign) / "plan.json")
    if args.json:
        print(json.dumps(choice.to_dict(), indent=1))
    else:
        print("\n".join(choice.lines(cost.step_seconds)))
        print(f"wrote {out} (attnchecker train --plan {out}; in Python: "
              f"ABFTConfig.from_dict(json.load(f)['config']))")  # fmt: skip
    if choice.checks:  # priced beside the options: ABFT there, the guard with replay elsewhere
        from attnchecker.adaptive.price import Mixture

        label = f"this plan ({len(choice.checks)} checks) with replay"
        mixture = Mixture("plan", label, choice.checks, choice.measured or choice.overhead)
        _pricing(args, cost, rate, (mixture,))
    return 0


def _pricing(args: argparse.Namespace, cost, rate, mixtures: tuple = ()):
    """Every option (and ``mixtures``) priced at ``rate`` (printed, written to pricing.json), or
    None when the campaign has no recovery arms."""
    import json

    from attnchecker.adaptive.price import PRESETS, Job, price, trials_of

    try:
        trials_of(args.campaign, cost.family)
    except ConfigError:
        return None
    job = Job(args.step_seconds or cost.step_seconds, args.devices or 1, args.checkpoint_every,
              60 * args.restart_minutes, args.sdc_steps)  # fmt: skip
    given = _overheads(args.overheads)
    if given:  # measured or modelled elsewhere (a GPU's), in place of this cost profile's
        cost = dataclasses.replace(cost, recovery={**cost.recovery, **given})
    priced = price(args.campaign, cost, rate, job, mixtures=mixtures)
    lines = priced.lines()
    if given:
        lines.append("note: overheads given (--overheads), not measured by this cost profile: "
                     + ", ".join(f"{k} {v.point:+.1%}" for k, v in given.items()))  # fmt: skip
    if args.preset:
        lines.append(f"note: --preset {args.preset}: {PRESETS[args.preset][2]}")
    if not args.step_seconds:
        lines.append(f"note: a step of {job.step_seconds:.3g} s is this machine's plain step of "
                     f"the campaign's model: give --step-seconds for your job's")  # fmt: skip
    path = (Path(args.out).parent if args.out else Path(args.campaign)) / "pricing.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(priced.to_dict(), indent=1))
    if not args.json:
        print("\n".join(lines))
        print(f"wrote {path}")
    return priced


def _validate(args: argparse.Namespace) -> int:
    """Check the controller's claims by training under faults sampled at the rate (make it high:
    events in minutes), several seeds per row, each its own fault plan: no check and each
    budget's choice; at one budget the naive baselines at the overhead the controller's choice
    measured (every check every k steps, forward only, a random subset: of each the dearest
    whose measured overhead is no more) and the held-out conditions (another init seed,
    Shakespeare text, a trained checkpoint, patterns 1R / 1C / 2D, unseen kinds, rates x 0.5
    and x 2, unprofiled sites). Each row's counts are set against a calibrated predictive
    interval, its overhead against its budget and predicted interval; the baselines' gains are
    paired differences.
    Exit status 1 when a claim is broken upwards (more events or overhead than claimed, a
    budget exceeded), 3 when the only misses are below the claims (wrong on the safe side).

    outputs: <campaign>/frontier/frontier.{json,md,png}

    example: attnchecker validate --campaign runs/camp --fault-rate 1 --per step --budgets 10% 20%
    """
    from attnchecker.adaptive.validate import HELD_OUT, validate
    from attnchecker.report.adaptive import frontier_report, frontier_rows

    vuln, cost, rate = _profiles(args)
    if args.pricing:
        return _check_pricing(args, vuln, cost, rate)
    if not args.budgets:
        raise ConfigError("give --budgets (the controller's schedules) or --pricing (the options)")
    meta = {"family": vuln.family, "rate": f"{rate.value:g} faults per {rate.per}",
            "pooled_layers": args.pool_layers,
            "campaign": str(args.campaign), "cost": cost.setup}  # fmt: skip
    out = args.out or Path(args.campaign) / "frontier"
    val = validate(vuln, cost, rate, args.budgets, seeds=args.seeds, steps=args.steps,
                   level=args.level, at=args.at,
                   held_out=() if args.in_sample or args.no_held_out else HELD_OUT,
                   with_baselines=not args.in_sample, timing_reps=args.timing_reps,
                   seed=args.seed, verify=args.verify, progress=True,
                   on_row=lambda partial: frontier_report(partial, out, meta))  # fmt: skip
    path = frontier_report(val, out, meta)
    print("\n".join(frontier_rows(val)))
    print(f"wrote {path}")
    return val.status


def _overheads(text: str | None) -> dict:
    """``--overheads guard=0,abft=1.7%``: the options' overheads as fractions."""
    from attnchecker.adaptive.profile import RECOVERY_ARMS, Estimate

    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in RECOVERY_ARMS or not value:
            raise ConfigError(f"--overheads is {'=..,'.join(RECOVERY_ARMS)}=.. (e.g. "
                              f"guard=0,abft=1.7%), got {text!r}")  # fmt: skip
        x = _fraction(value)
        out[key] = Estimate(x, x, x)
    return out


def _check_pricing(args: argparse.Namespace, vuln, cost, rate) -> int:
    """``validate --pricing``: every option simulated against the pricing's predictions."""
    import json

    from attnchecker.adaptive.price_check import HELD_OUT, check_pricing

    if args.budgets and len(args.budgets) > 1:
        raise ConfigError("validate --pricing takes one budget (the plan's schedule against "
                          "naive ones at its measured cost)")  # fmt: skip
    out = Path(args.out or Path(args.campaign) / "pricing_check")
    out.mkdir(parents=True, exist_ok=True)
    check = check_pricing(vuln, cost, args.campaign, rate, steps=args.steps, seeds=args.seeds,
                          level=args.level, held_out=() if args.no_held_out else HELD_OUT,
                          budget=args.budgets[0] if args.budgets else None,
                          timing_reps=args.timing_reps, seed=args.seed,
                          progress=lambda line: print(line, flush=True))  # fmt: skip
    (out / "pricing_check.json").write_text(json.dumps(check.to_dict(), indent=1))
    text = "\n".join(check.lines())
    (out / "pricing_check.md").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'pricing_check.md'}")
    return check.status


def _rate_args(p: argparse.ArgumentParser, *, preset: bool = False) -> None:
    p.add_argument("--campaign", required=True, help="a campaign directory")
    p.add_argument("--family", help="the campaign's family (needed when it has several)")
    p.add_argument("--cost", help="cost profile (default: <campaign>/cost-<family>.json)")
    p.add_argument("--fault-rate", type=float, required=not preset, help="faults per --per")
    if preset:
        from attnchecker.adaptive.price import PRESETS

        p.add_argument("--preset", choices=sorted(PRESETS),
                       help="a quoted fault rate per device, with its devices: "
                       + "; ".join(f"{k}: {v[2]}" for k, v in PRESETS.items()))  # fmt: skip
    p.add_argument("--per", default="device-hour", choices=RATE_UNITS,
                   help="element-op: per multiply-add; step or device-hour: spread over the "
                   "step's GEMMs by their work")  # fmt: skip
    p.add_argument("--kinds", help="kind distribution, e.g. nan=0.5,inf=0.5 (default: uniform "
                   "over the campaign's kinds)")  # fmt: skip
    p.add_argument("--pool-layers", action="store_true",
                   help="one vulnerability per op from the trials of every layer (tighter "
                   "intervals from few trials; assumes the layers alike)")  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add this group's commands to ``sub``."""
    b = add_command(sub, "bench", _bench, "cost profile: what each check costs on this machine")
    b.add_argument("--model", metavar="MODEL",
                   help="a family, a transformers config.json, or package.module:function "
                   "(default: the campaign's model)")  # fmt: skip
    b.add_argument("--campaign", help="take the model and batch shape from this campaign")
    b.add_argument("--size", default="tiny", choices=SIZES)
    b.add_argument("--batch", type=int, default=4)
    b.add_argument("--seq-len", type=int, default=32)
    b.add_argument("--compile", action="store_true", help="time every arm under torch.compile")
    b.add_argument("--dtype", default="fp32", choices=DTYPES)
    b.add_argument("--device", default="cpu")
    b.add_argument("--reps", type=int, default=15, help="rounds (every arm steps once each)")
    b.add_argument("--ops", nargs="+", help="only these ops (e.g. with --compile: an arm each)")
    b.add_argument("--out", help="cost profile file")

    summary = "what to run at a fault rate, priced in training time; what to check for a target"
    p = add_command(sub, "plan", _plan, summary)
    _rate_args(p, preset=True)
    p.add_argument(
        "--step-seconds",
        type=float,
        help="your job's training step (default: this machine's plain step)",
    )
    p.add_argument(
        "--devices",
        type=int,
        help="devices whose faults hit each step (a rate per device-hour / -day)",
    )
    p.add_argument("--checkpoint-every", type=int, default=1000, help="steps between checkpoints")
    p.add_argument(
        "--restart-minutes",
        type=float,
        default=15.0,
        help="from a crash or NaN back to training: relaunch and load",
    )
    p.add_argument("--overheads",
                   help="the options' overheads measured or modelled elsewhere (your GPU's), "
                   "in place of the cost profile's: guard=0.1%%,abft=1.7%%")  # fmt: skip
    p.add_argument("--sdc-steps", type=float,
                   help="a silent deviation's cost in steps (default: a restart's)")  # fmt: skip
    goal = p.add_mutually_exclusive_group()
    goal.add_argument("--target", type=float, help="non-trainable events per million steps")
    goal.add_argument("--budget", type=_fraction, help="overhead, e.g. 5%% or 0.05")
    p.add_argument("--confidence", type=float, default=0.95, choices=CONFIDENCES)
    p.add_argument("--estimate", default="high", choices=ESTIMATES,
                   help="which end of the risk intervals decides")  # fmt: skip
    p.add_argument("--out", help="plan file (default: <campaign>/plan.json)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="time the budget's choice on this machine; back off until it fits",
    )
    p.add_argument("--timing-reps", type=int, default=9, help="rounds of each timing (--verify)")
    p.add_argument("--json", action="store_true", help="print the choice as JSON")

    summary = "simulate training under faults: predicted vs measured frontier"
    v = add_command(sub, "validate", _validate, summary)
    _rate_args(v)
    v.add_argument(
        "--budgets",
        nargs="+",
        type=_fraction,
        help="the controller's schedules to validate (with --pricing: one budget, whose "
        "schedule is run against naive ones at its measured cost)",
    )
    v.add_argument("--pricing", action="store_true",
                   help="validate plan's pricing instead: every option (no protection, the "
                   "finite-gradient guard, ABFT; skipping or replaying) simulated under faults, "
                   "its replays, skips, non-trainable events, corrections and silent deviations "
                   "against their predicted intervals, its overhead against bench's; needs a "
                   "campaign run with --recovery-arms and --per step")  # fmt: skip
    v.add_argument("--steps", type=int, default=200, help="training steps per run")
    v.add_argument("--seeds", type=int, default=5, help="runs per row, each its own fault plan")
    v.add_argument("--level", type=float, default=0.9, help="of the predictive intervals")
    v.add_argument(
        "--at",
        type=_fraction,
        help="budget of the baselines and held-out rows (default: the middle one)",
    )
    v.add_argument(
        "--in-sample",
        action="store_true",
        help="only no check and the budgets' choices (no baselines, no held-out rows)",
    )
    v.add_argument("--no-held-out", action="store_true", help="no held-out rows")
    v.add_argument("--verify", action="store_true",
                   help="each budget's choice as plan --verify ships it")  # fmt: skip
    v.add_argument("--timing-reps", type=int, default=9)
    v.add_argument("--seed", type=int, default=0, help="the first run's seed")
    v.add_argument("--out", help="report directory (default: <campaign>/frontier)")
