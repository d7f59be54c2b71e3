"""The frontier report of adaptive protection: predicted vs measured overhead and risk for
several budgets (``attnchecker validate``): ``frontier.json``, ``frontier.md``, ``frontier.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["frontier_report", "frontier_rows", "rebuild_frontier"]


def frontier_rows(sims) -> list[str]:
    lines = [
        "| budget | checks | faults | non-trainable measured | predicted [interval of the count] "
        "| count | overhead measured | predicted | inside |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sims:
        p, o, q = s.predicted_events, s.overhead, s.predicted_overhead
        lines.append(
            f"| {'none' if not s.budget else f'{s.budget:.0%}'} | {len(s.checks)} | {s.faults} "
            f"| {s.events} | {p.point:.1f} [{s.events_interval[0]}, {s.events_interval[1]}] "
            f"| {s.verdict} | {o.point:+.1%} [{o.low:+.1%}, {o.high:+.1%}] "
            f"| {q.point:+.1%} [{q.low:+.1%}, {q.high:+.1%}] "
            f"| {'yes' if s.overhead_inside else 'NO'} |"
        )
    return lines


def _plot(sims, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnchecker.adaptive.simulate import count_interval

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(sims):
        per = 1e6 / s.steps  # events per million steps
        p, q = s.predicted_events, s.predicted_overhead
        ax.errorbar(100 * q.point, per * p.point, xerr=[[100 * (q.point - q.low)],
                    [100 * (q.high - q.point)]], yerr=[[per * (p.point - s.events_interval[0])],
                    [per * (s.events_interval[1] - p.point)]], fmt="s", color="tab:blue",
                    alpha=0.5, capsize=3, label="predicted" if i == 0 else None)  # fmt: skip
        o, (lo, hi) = s.overhead, count_interval(s.events)
        ax.errorbar(100 * o.point, per * s.events, xerr=[[100 * (o.point - o.low)],
                    [100 * (o.high - o.point)]], yerr=[[per * (s.events - lo)],
                    [per * (hi - s.events)]], fmt="o", color="tab:red", capsize=3,
                    label="measured" if i == 0 else None)  # fmt: skip
        ax.annotate("none" if not s.budget else f"budget {s.budget:.0%}",
                    (100 * o.point, per * s.events), textcoords="offset points", xytext=(6, 6),
                    fontsize=8)  # fmt: skip
    ax.set_xlabel("overhead vs the plain model (SDPA), %")
    ax.set_ylabel("non-trainable events per million steps")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def frontier_report(sims, out: str | Path, meta: dict[str, Any]) -> Path:
    """Write the frontier's files under ``out``; returns the markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(
        json.dumps({"meta": meta, "points": [s.to_dict() for s in sims]}, indent=1)
    )
    title = f"{meta.get('family')}: predicted vs measured at {meta.get('rate')}"
    _plot(sims, out / "frontier.png", title)
    md = [f"# Adaptive protection: the frontier ({meta.get('family')})", "",
          f"Fault rate {meta.get('rate')}, {sims[0].steps} steps per point. Predicted: the "
          "controller's expected count and the Poisson interval at the ends of its risk "
          "interval; measured: the count of non-trainable steps (plotted with its exact Poisson "
          "interval), and the overhead (median of alternated clean steps against the plain "
          "model with SDPA).", "",
          *frontier_rows(sims), "", "![frontier](frontier.png)", ""]  # fmt: skip
    path = out / "frontier.md"
    path.write_text("\n".join(md))
    return path


def rebuild_frontier(out: str | Path) -> Path:
    """The report again from ``out/frontier.json`` alone."""
    from attnchecker.adaptive.simulate import Simulation

    d = json.loads((Path(out) / "frontier.json").read_text())
    return frontier_report([Simulation.from_dict(x) for x in d["points"]], out, d["meta"])
