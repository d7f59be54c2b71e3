"""Reports built from run files alone: tables and plots (matplotlib is imported only here)."""

from __future__ import annotations

from pathlib import Path

from attnchecker.errors import ConfigError
from attnchecker.report.campaign import campaign_report

__all__ = ["RUN_KINDS", "campaign_report", "report", "run_kind"]

RUN_KINDS = ("campaign", "demo", "frontier", "training", "sdc")
"""What a run directory can hold, each with its report (:func:`report`)."""


def run_kind(out: str | Path) -> str | None:
    """Which of :data:`RUN_KINDS` the directory ``out`` holds, from its files (None: none)."""
    out = Path(out)
    if any(out.glob("trials*.jsonl")):
        return "campaign"
    if (out / "summary.json").exists() and (out / "reference").is_dir():
        return "demo"
    if (out / "frontier.json").exists():
        return "frontier"
    if (out / "metrics.jsonl").exists():
        return "training"
    if (out / "steps.jsonl").exists() and (out / "summary.json").exists():
        return "sdc"
    return None


def report(out: str | Path) -> Path:
    """Build the report of whatever run directory ``out`` holds; returns its path. Raises
    :class:`~attnchecker.errors.ConfigError` for a directory that holds none."""
    kind = run_kind(out)
    if kind == "campaign":
        return campaign_report(out)
    if kind == "demo":
        from attnchecker.report.training import demo_report

        return demo_report(out)
    if kind == "frontier":
        from attnchecker.report.adaptive import rebuild_frontier

        return rebuild_frontier(out)
    if kind == "training":
        from attnchecker.report.training import run_report

        return run_report(out)
    if kind == "sdc":
        from attnchecker.report.sdc import sdc_report

        return sdc_report(out)
    raise ConfigError(f"{out}: not a campaign, demo or training run directory")
