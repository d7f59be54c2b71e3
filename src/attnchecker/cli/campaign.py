"""The commands that measure errors: ``campaign`` and ``report``."""

from __future__ import annotations

import argparse
import os

from attnchecker.cli.common import add_backend, add_command
from attnchecker.inject.campaign import CampaignConfig
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import SIZES

__all__ = ["TASK", "add_parser"]

TASK = ("measure errors", "campaign, report")


def _split(values: list[str]) -> tuple[str, ...]:
    """``["a,b", "c"]`` -> (a, b, c): "-inf" must come inside a comma list, or argparse takes it
    for an option."""
    return tuple(v for arg in values for v in arg.split(",") if v)


def _campaign(args: argparse.Namespace) -> int:
    """For every family x site x kind x pattern, seeded trials train a short run twice under the
    same fault, unprotected and protected, and record how the error propagated and whether
    training survived. Sizes: tiny (hidden 32), small (256), base (768). Interrupted campaigns
    resume from their trials file.

    outputs: <out>/trials.jsonl (one line per trial), summary.json (rates per cell), meta.json,
    report.html, vulnerability-<family>.json (for attnchecker plan)

    example: attnchecker campaign --out runs/camp --families gpt2 llama --trials 4
    """
    from attnchecker.adaptive.profile import write_vulnerability_profiles
    from attnchecker.inject.campaign import run_campaign
    from attnchecker.report import campaign_report

    cfg = CampaignConfig(
        families=_split(args.families), sites=_split(args.sites), kinds=_split(args.kinds),
        patterns=_split(args.patterns), trials=args.trials, steps=args.steps, layer=args.layer,
        layers=tuple(args.layers) if args.layers else None,
        size=args.size, seed=args.seed, workers=args.workers, backend=args.backend,
        check_arms=args.check_arms,
        recovery_arms=args.recovery_arms,
        dropout=not args.no_dropout,
        rank=int(os.environ.get("RANK", 0)) if args.rank is None else args.rank,
        world=int(os.environ.get("WORLD_SIZE", 1)) if args.world is None else args.world,
    )  # fmt: skip
    summary = run_campaign(cfg, args.out)
    profiles = ", ".join(p.name for p in write_vulnerability_profiles(args.out))
    print(f"{summary['trials']} trials in {args.out}; report: {campaign_report(args.out)}; "
          f"vulnerability profiles: {profiles}")  # fmt: skip
    return 0


def _report(args: argparse.Namespace) -> int:
    """example: attnchecker report runs/camp (writes runs/camp/report.html)"""
    from attnchecker.report import report

    print(report(args.out))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add this group's commands to ``sub``."""
    camp = add_command(
        sub, "campaign", _campaign, "fault-injection campaign: trials, rates, report"
    )
    camp.add_argument("--out", required=True, help="run directory (resumes if it has trials)")
    camp.add_argument(
        "--families", nargs="+", default=list(CampaignConfig.families),
        help=f"model types of the family table (default: ATTNChecker's four); any of "
        f"{', '.join(FAMILIES)}; or your own PyTorch model as package.module:function (called "
        f"with vocab_size= and seq_len=, as attnchecker train --model takes it)",
    )  # fmt: skip
    camp.add_argument("--sites", nargs="+", default=list(CampaignConfig.sites))
    camp.add_argument(
        "--kinds", nargs="+", default=list(CampaignConfig.kinds),
        help="fault kinds; give -inf inside a comma list, e.g. --kinds inf,-inf,nan",
    )  # fmt: skip
    camp.add_argument("--patterns", nargs="+", default=list(CampaignConfig.patterns))
    camp.add_argument("--trials", type=int, default=1, help="trials per combination")
    camp.add_argument("--steps", type=int, default=3, help="training steps per run")
    camp.add_argument("--layer", type=int, default=0)
    camp.add_argument("--layers", type=int, nargs="+", help="faulty layers (instead of --layer)")
    add_backend(camp, "attention backend of both arms; triton adds the sites kernel:s .. kernel:dq")
    camp.add_argument(
        "--check-arms", action="store_true",
        help="also run every non-trainable trial with each check alone (skip_step): what each "
        "check covers, for attnchecker plan (several times the trials' time)",
    )  # fmt: skip
    camp.add_argument(
        "--recovery-arms", action="store_true",
        help="also run every trial with the finite-gradient guard alone and with protection, "
        "each skipping or replaying a step that went wrong: the outcomes attnchecker plan "
        "prices (about three times the trials' time)",
    )  # fmt: skip
    camp.add_argument(
        "--no-dropout", action="store_true",
        help="every dropout probability 0 (with --backend triton: the fused kernels run "
        "attention dropout in training on the eager engine)",
    )  # fmt: skip
    camp.add_argument("--size", default="tiny", choices=SIZES)
    camp.add_argument("--seed", type=int, default=0)
    camp.add_argument("--workers", type=int, default=1, help="processes")
    camp.add_argument(
        "--rank", type=int, default=None, help="this shard (default: $RANK, torchrun)"
    )
    camp.add_argument("--world", type=int, default=None, help="shards (default: $WORLD_SIZE)")
    rep = add_command(
        sub, "report", _report, "rebuild a campaign's, demo's or run's report from files"
    )
    rep.add_argument("out")
