"""An SDC lockstep run's report from its files alone: ``report.html`` with PNG plots."""

from __future__ import annotations

import html
import json
from collections import defaultdict
from pathlib import Path

__all__ = ["sdc_report"]


def sdc_report(out: str | Path) -> Path:
    """Level 1: mismatch frequency per layer x submodule over steps; level 2: gradient
    noise-to-signal over steps; level 3: loss and drift curves beside the control."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines() if x.strip()]
    level = summary["level"]
    fig, axes = plt.subplots(
        1, 2 if level == 3 else 1, figsize=(10 if level == 3 else 7, 3.5), squeeze=False
    )
    ax = axes[0][0]
    if level == 1:
        series = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for r in rows:
            acc = series[f"L{r['layer']} {r['submodule']} {r['direction']}"][r["step"]]
            acc[0] += r["mismatches"]
            acc[1] += r["elements"]
        for name, by_step in sorted(series.items()):
            steps = sorted(by_step)
            ax.plot(steps, [by_step[s][0] / by_step[s][1] for s in steps], label=name, lw=1)
        ax.set_ylabel("mismatch frequency")
        ax.legend(fontsize=6)
    elif level == 2:
        ax.plot([r["step"] for r in rows], [r["gradient_nsr"] for r in rows])
        ax.set_ylabel("||g_f - g_h|| / ||g_h||")
    else:
        steps = [r["step"] for r in rows]
        for key in ("healthy", "faulty", "control", "loss"):  # "loss": a rank's own, two-rank mode
            if rows and key in rows[0]:
                ax.plot(steps, [r[key] for r in rows], label=key)
        ax.set_ylabel("loss")
        ax.legend()
        ax2 = axes[0][1]
        for key, label in (("drift", "faulty vs healthy"), ("control_drift", "control vs healthy")):
            if rows and key in rows[0]:
                ax2.plot(steps, [max(r[key], 1e-16) for r in rows], label=label)
        ax2.set_ylabel("parameter drift")
        ax2.set_yscale("log")
        ax2.legend()
    for a in axes[0]:
        a.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / f"level{level}.png", dpi=120)
    plt.close(fig)
    items = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(v))}</td></tr>"
        for k, v in summary.items()
        if k != "per_layer_drift"
    )
    page = f"""<!doctype html><meta charset="utf-8"><title>SDC lockstep, level {level}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td{{padding:.2em .6em;border-bottom:1px solid #ddd}}</style>
<h1>SDC lockstep, level {level}</h1><table>{items}</table><img src="level{level}.png" alt="plot">
"""
    path = out / "report.html"
    path.write_text(page)
    return path
