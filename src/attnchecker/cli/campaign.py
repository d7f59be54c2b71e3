"""The commands that measure errors: ``campaign`` and ``report``."""

from __future__ import annotations

import argparse
import os
import sys

from attnchecker.attention.config import BACKENDS
from attnchecker.inject.kinds import DEFAULT_KINDS
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import SIZES

__all__ = ["add_parser"]


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
    from attnchecker.cli.adaptive import write_profiles

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


def add_parser(sub: argparse._SubParsersAction, formatter: type) -> None:
    """Add this group's commands to ``sub``."""

    from attnchecker.attention.config import OPS

    camp = sub.add_parser(
        "campaign", help="fault-injection campaign: trials, rates, report",
        formatter_class=formatter,
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
    rep = sub.add_parser(
        "report", help="rebuild a campaign's, demo's or run's report from files",
        formatter_class=formatter,
        epilog="example: attnchecker report runs/camp (writes runs/camp/report.html)",
    )  # fmt: skip
    rep.add_argument("out")
    rep.set_defaults(func=_report)
