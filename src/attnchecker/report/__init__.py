"""Reports built from run files alone: tables and plots (matplotlib is imported only here)."""

from attnchecker.report.campaign import campaign_report

__all__ = ["campaign_report"]
