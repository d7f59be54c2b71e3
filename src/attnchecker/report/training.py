"""The training demo's report from its run directories alone: ``report.html`` with PNG plots."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "COLUMNS", "arm_row", "demo_report", "read_metrics"]

ARMS = ("reference", "unprotected", "checkpoint_restore", "protected")
COLUMNS = (
    "arm",
    "faults",
    "detected",
    "corrected",
    "final loss",
    "non-trainable",
    "wall s",
    "overhead",
    "recovery cost",
)


def read_metrics(run: Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def demo_report(out: str | Path) -> Path:
    """``out/<arm>/`` run directories -> ``out/report.html``, ``out/loss.png``, ``out/time.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    arms = [a for a in ARMS if (out / a / "metrics.jsonl").exists()]
    fig, ax = plt.subplots(figsize=(8, 4))
    for arm in arms:
        rows = read_metrics(out / arm)
        ax.plot(
            [r["step"] for r in rows],
            [r["loss"] for r in rows],
            label=arm,
            lw=2 if arm == "protected" else 1.2,
        )
    faults = [r for r in _events(out / "protected") if r.get("type") == "fault"]
    for f in faults:
        ax.axvline(f["step"], color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Same seeded faults (dotted), four arms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 3))
    for i, arm in enumerate(arms):
        s = summary[arm]
        train_s = s["wall_time_s"] - s["save_s"] - s["load_s"]
        ax.barh(i, train_s, color="tab:blue", label="training" if i == 0 else None)
        ax.barh(
            i,
            s["save_s"],
            left=train_s,
            color="tab:orange",
            label="checkpoint save" if i == 0 else None,
        )
        ax.barh(
            i,
            s["load_s"],
            left=train_s + s["save_s"],
            color="tab:red",
            label="checkpoint load" if i == 0 else None,
        )
    ax.set_yticks(range(len(arms)), arms)
    ax.set_xlabel("wall time (s)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "time.png", dpi=120)
    plt.close(fig)

    rows_html = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in arm_row(arm, summary)) + "</tr>"
        for arm in arms
    )
    page = f"""<!doctype html><meta charset="utf-8"><title>attnchecker demo</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .6em;border-bottom:1px solid #ddd}}</style>
<h1>attnchecker: the same faults, four ways</h1>
<p>{html.escape(summary.get("description", ""))}</p>
<table><tr>{"".join(f"<th>{h}</th>" for h in COLUMNS)}</tr>{rows_html}</table>
<h2>Loss</h2><img src="loss.png" alt="loss curves">
<h2>Where the time went</h2><img src="time.png" alt="time breakdown">
"""
    path = out / "report.html"
    path.write_text(page)
    return path


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )


def arm_row(arm: str, summary: dict[str, Any]) -> list[str]:
    """One arm of the demo's ``summary.json`` as the cells of :data:`COLUMNS`."""
    s = summary[arm]
    recovery = ""
    if s["saves"]:
        recovery = f"{s['recovery_cost_steps']:.1f} steps, {s['rollbacks']} rollbacks"
    return [
        arm, str(s["faults_injected"]), str(s["faults_detected"]), str(s["faults_corrected"]),
        f"{s['final_loss']:.4f}", "yes" if s["non_trainable"] else "no", f"{s['wall_time_s']:.1f}",
        "" if arm == "reference" else f"{100 * s['overhead']:+.0f}%", recovery,
    ]  # fmt: skip


def run_report(run: str | Path) -> Path:
    """One ``attnchecker train`` run directory -> ``report.html`` with its loss curve and events."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run)
    rows = read_metrics(run)
    summary = json.loads((run / "summary.json").read_text())
    events = _events(run)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    for e in events:
        if e.get("type") == "fault":
            ax.axvline(e["step"], color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(run / "loss.png", dpi=120)
    plt.close(fig)
    kinds = {}
    for e in events:
        kinds[e.get("type", "?")] = kinds.get(e.get("type", "?"), 0) + 1
    items = "".join(
        f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in summary.items()
    )
    page = f"""<!doctype html><meta charset="utf-8"><title>attnchecker run</title>
<style>body{{font-family:sans-serif;max-width:50em;margin:2em auto}}td{{padding:.2em .6em;border-bottom:1px solid #ddd}}</style>
<h1>{html.escape(str(run))}</h1><table>{items}</table>
<p>events: {html.escape(json.dumps(kinds))}</p><img src="loss.png" alt="loss">
"""
    path = run / "report.html"
    path.write_text(page)
    return path
