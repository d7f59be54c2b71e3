"""The validation report of adaptive protection (``attnchecker validate``): each row's measured
counts and overhead against its predictions, the coverage of the predictive intervals, the
controller's gain over the naive baselines, the misses; ``frontier.json`` (everything, from
which the report is rebuilt), ``frontier.md`` and ``frontier.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnchecker.errors import ConfigError

__all__ = ["frontier_report", "frontier_rows", "rebuild_frontier"]


def _pct(e) -> str:
    return f"{e[0]:+.1%} [{e[1]:+.1%}, {e[2]:+.1%}]"


def frontier_rows(val) -> list[str]:
    """The rows' table, the coverage, the gains and the misses, as markdown lines."""
    level = f"{val.level:.0%}"
    lines = [
        f"| row | checks | faults per run | non-trainable per seed | predicted mean [{level} "
        "interval] | inside | count | updates skipped per seed | overhead measured | predicted "
        "| overhead |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in val.rows:
        p = r.predicted
        judged = "" if r.judged else " (counts not judged)"
        faults = sum(x.faults for x in r.runs) / len(r.runs)
        lines.append(
            f"| {r.name}{judged} | {len(r.checks)} | {faults:.0f} | "
            f"{', '.join(str(x.events) for x in r.runs)} | {p.mean:.1f} [{p.low}, {p.high}] | "
            f"{r.inside} of {len(r.runs)} | {r.count_verdict} | "
            f"{', '.join(str(x.skipped) for x in r.runs)} | {_pct(r.overhead)} | "
            f"{_pct(r.predicted_overhead)} | {r.overhead_verdict} |"
        )
    inside, n = val.coverage()
    lines += ["", f"**Coverage: {inside} of {n} counts inside their {level} predictive "
              "intervals** (judged rows; in-sample "
              f"{'{} of {}'.format(*val.coverage('in-sample'))}, held-out "
              f"{'{} of {}'.format(*val.coverage('held-out'))}, baselines "
              f"{'{} of {}'.format(*val.coverage('baseline'))})."]  # fmt: skip
    if val.gains:
        lines += ["", "Each baseline is the dearest of its kind whose measured overhead is at most "
                  "the controller's (row names: ~ that overhead); the gains are paired over the "
                  "seeds' fault plans.", "",
                  "| the controller against | events removed per run (baseline - controller) "
                  "| mean [95% t interval] |", "|---|---|---|"]  # fmt: skip
        for g in val.gains:
            m = g.mean
            lines.append(f"| {g.baseline} | {', '.join(map(str, g.differences))} | "
                         f"{m.point:+.1f} [{m.low:+.1f}, {m.high:+.1f}] |")  # fmt: skip
    lines += [f"- note: {n}" for n in val.notes]
    misses = val.misses()
    lines += ["", f"**Misses ({len(misses)}; exit status {val.status})**" + (":" if misses else
              ": none.")] + [f"- {m}" for m in misses]  # fmt: skip
    return lines


def _plot(val, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colours = {
        "in-sample": "tab:red",
        "baseline": "tab:green",
        "held-out": "tab:purple",
        "reference": "tab:gray",
    }
    seen = set()
    for r in val.rows:
        per = 1e6 / r.steps  # events per million steps
        p, q, o = r.predicted, r.predicted_overhead, r.overhead
        events = [x.events for x in r.runs]
        mean = sum(events) / len(events)
        if r.kind == "in-sample":
            ax.errorbar(100 * q[0], per * p.mean, xerr=[[100 * (q[0] - q[1])], [100 * (q[2] - q[0])]],
                        yerr=[[per * (p.mean - p.low)], [per * (p.high - p.mean)]], fmt="s",
                        color="tab:blue", alpha=0.4, capsize=3,
                        label=None if "predicted" in seen else "predicted")  # fmt: skip
            seen.add("predicted")
        ax.errorbar(100 * o[0], per * mean, xerr=[[100 * (o[0] - o[1])], [100 * (o[2] - o[0])]],
                    yerr=[[per * (mean - min(events))], [per * (max(events) - mean)]], fmt="o",
                    color=colours[r.kind], capsize=3,
                    label=None if r.kind in seen else f"measured: {r.kind}")  # fmt: skip
        seen.add(r.kind)
        if r.kind != "held-out":
            ax.annotate(r.name, (100 * o[0], per * mean), textcoords="offset points",
                        xytext=(6, 6), fontsize=7)  # fmt: skip
    ax.set_xlabel("overhead vs the plain model (SDPA), %")
    ax.set_ylabel("non-trainable events per million steps (seeds: mean, range)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def frontier_report(val, out: str | Path, meta: dict[str, Any]) -> Path:
    """Write the validation's files under ``out``; returns the markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps({"meta": meta, **val.to_dict()}, indent=1))
    title = f"{meta.get('family')}: predicted vs measured at {meta.get('rate')}"
    _plot(val, out / "frontier.png", title)
    r0 = val.rows[0]
    md = [f"# Adaptive protection: validation ({meta.get('family')})", "",
          f"Fault rate {meta.get('rate')}, {r0.steps} steps per run, {len(r0.runs)} seeds per "
          "row (each its own fault plan, the same plans in every row). Predicted: the mean and "
          f"the {val.level:.0%} predictive interval of a run's count of non-trainable steps "
          "(the controller's model with its cells' posteriors and Poisson counts); a "
          "row's counts miss when too few fall inside (binomial test at 5%). Updates skipped: "
          "steps whose update the guard skipped (a detection that could not be corrected: "
          "training went on, the step's progress was lost; not a non-trainable step). "
          "Overhead: median "
          "of alternated clean steps against the plain model with SDPA; it must stay within "
          "the budget and its predicted interval.", "",
          *frontier_rows(val), "", "![frontier](frontier.png)", ""]  # fmt: skip
    path = out / "frontier.md"
    path.write_text("\n".join(md))
    return path


def rebuild_frontier(out: str | Path) -> Path:
    """The report again from ``out/frontier.json`` alone."""
    from attnchecker.adaptive.validate import Validation

    d = json.loads((Path(out) / "frontier.json").read_text())
    if "rows" not in d:  # the one-seed frontier of attnchecker before 2026-12-04
        raise ConfigError(
            f"{out}/frontier.json is an older frontier (one run per budget, uncalibrated "
            f"intervals), which this version does not rebuild; its frontier.md is as written, "
            f"or rerun attnchecker validate"
        )
    return frontier_report(Validation.from_dict(d), out, d["meta"])
