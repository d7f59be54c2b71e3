"""The training demo's report from its run directories alone: ``report.html`` with PNG plots."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

__all__ = ["ARMS", "COLUMNS", "arm_row", "demo_report", "overhead_note", "read_metrics"]

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
    style = {"reference": {"color": "black", "ls": "--", "lw": 1.2, "zorder": 3},
             "protected": {"lw": 2.5}}  # fmt: skip
    for arm in arms:
        # the trajectory kept: a step replayed after a rollback replaces the one rolled back
        kept = {r["step"]: r["loss"] for r in read_metrics(out / arm)}
        steps, losses = sorted(kept), [kept[st] for st in sorted(kept)]
        (line,) = ax.plot(steps, losses, label=arm, **style.get(arm, {"lw": 1.2}))
        finite = [(st, lo) for st, lo in zip(steps, losses, strict=True) if _finite(lo)]
        if summary[arm]["non_trainable"] and finite:  # where it died
            died = next((st for st, lo in zip(steps, losses, strict=True) if not _finite(lo)),
                        steps[-1])  # fmt: skip
            ax.plot([died], [finite[-1][1]], "x", ms=12, mew=3, color=line.get_color())
            ax.annotate(f"{arm} dies", (died, finite[-1][1]), textcoords="offset points",
                        xytext=(6, 6), color=line.get_color())  # fmt: skip
        at = dict(finite)
        for e in _events(out / arm):
            if e.get("type") == "rollback" and e["at_step"] in at:  # the step that went bad
                ax.annotate("", (e["at_step"], at[e["at_step"]]), xytext=(0, 18),
                            textcoords="offset points",
                            arrowprops={"arrowstyle": "-|>", "color": line.get_color()})  # fmt: skip
            if e.get("type") == "protection" and e.get("step") in at:
                ax.plot([e["step"]], [at[e["step"]]], "o", ms=7, mfc="none", color="tab:green")
    faults = [r for r in _events(out / "protected") if r.get("type") == "fault"]
    for f in faults:
        ax.axvline(f["step"], color="grey", ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Same seeded faults (dotted): x = the arm dies, arrow = a rollback, o = corrected",
                 fontsize=10)  # fmt: skip
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
    story = "".join(f"<li>{html.escape(_story(arm, summary[arm], out / arm))}</li>" for arm in arms)
    plan = _table(["step", "site", "layer", "kind", "pattern"],
                  [[f.get(k, "") for k in ("step", "site", "layer", "kind", "pattern")]
                   for f in summary.get("faults", [])])  # fmt: skip
    event_keys = ["step", "module", "op", "pattern", "kind", "action", "cause"]
    events = _table(event_keys, [[e.get(k, "") for k in event_keys]
                                 for e in _events(out / "protected") if e.get("type") == "protection"])  # fmt: skip
    page = f"""<!doctype html><meta charset="utf-8"><title>attnchecker demo</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .6em;border-bottom:1px solid #ddd}}</style>
<h1>attnchecker: the same faults, four ways</h1>
<p>{html.escape(summary.get("description", ""))}</p>
<h2>What happened</h2><ul>{story}</ul>
<table><tr>{"".join(f"<th>{h}</th>" for h in COLUMNS)}</tr>{rows_html}</table>
<p>{html.escape(overhead_note(summary))}</p>
<h2>Loss</h2><img src="loss.png" alt="loss curves">
<h2>The fault plan</h2>{plan}
<h2>What protection found (the protected arm)</h2>{events}
<h2>Where the time went</h2><img src="time.png" alt="time breakdown">
{_diagnosis(out / "diagnosis")}"""
    path = out / "report.html"
    path.write_text(page)
    return path


def _quarantine(summary: dict[str, Any], *, meta: Path) -> str:
    """The devices a run named quarantine candidates (recovery.ledger), first: who, why, where
    the checks fired and at what size, and how to reproduce it."""
    named = summary.get("quarantine") or []
    if not named:
        return ""
    seed = json.loads(meta.read_text())["config"].get("seed") if meta.exists() else None
    rows = []
    for q in named:
        sites = "; ".join(f"{k}: {v}" for k, v in q["sites"].items())
        rows.append(
            f"<li><b>{html.escape(q['message'])}</b><br>sizes: {html.escape(sites)}<br>"
            f"replays: {html.escape(json.dumps(q['replays']))}<br>reproduce: "
            f"{html.escape(q['reproduce'])}" + (f" (seed {seed}, config in meta.json)"
                                                 if seed is not None else "") + "</li>"
        )  # fmt: skip
    return f"<h2>Quarantine candidates</h2><ul>{''.join(rows)}</ul>"


def _diagnosis(root: Path) -> str:
    """The diagnosis demo's two arms (``root/<arm>/``), step by step, if it ran."""
    arms = (
        sorted(p for p in root.glob("*") if (p / "events.jsonl").exists()) if root.exists() else []
    )
    if not arms:
        return ""
    found = {
        a.name: {e["step"]: e for e in _events(a) if e.get("type") == "diagnosis"} for a in arms
    }
    losses = {a.name: {r["step"]: r["loss"] for r in read_metrics(a)} for a in arms}
    steps = sorted(
        {st for f in found.values() for st in f} | {st for v in losses.values() for st in v}
    )
    rows = []
    for st in steps:
        row: list[Any] = [st]
        for a in arms:
            f, loss = found[a.name].get(st), losses[a.name].get(st)
            row += ["skipped" if loss is None else f"{loss:.3f}",
                    "healthy" if f is None else f"{f['verdict']}: {f['cause']}"]  # fmt: skip
        rows.append(row)
    head = ["step"] + [h for a in arms for h in (f"{a.name}: loss", f"{a.name}: diagnosis")]
    first = "".join(
        f"<li>{html.escape(a.name)}: {html.escape(next(iter(found[a.name].values()))['message'])}</li>"
        for a in arms if found[a.name]
    )  # fmt: skip
    return (f"<h2>Diagnosis: your hardware, or not</h2><p>Two protected, guarded runs: a device "
            f"that corrupts GEMMs, and an unstable run with no fault.</p>{_table(head, rows)}"
            f"<ul>{first}</ul>")  # fmt: skip


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and x == x and abs(x) != float("inf")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    if not rows:
        return "<p>none</p>"
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{''.join(f'<th>{h}</th>' for h in head)}</tr>{cells}</table>"


def _story(arm: str, s: dict[str, Any], run: Path) -> str:
    """What happened to one arm, in words."""
    events = _events(run)
    if arm == "reference":
        return f"reference: no fault, {s['steps_done']} steps, final loss {s['final_loss']:.4f}."
    if s["non_trainable"]:
        rows = read_metrics(run)
        died = next((r["step"] for r in rows if not _finite(r["loss"])), s["steps_done"])
        return (f"{arm}: died at step {died} (the loss became {rows[-1]['loss'] if rows else '?'}"
                f") after {s['faults_injected']} fault(s); training stopped there.")  # fmt: skip
    if s["rollbacks"]:
        at = [e["at_step"] for e in events if e.get("type") == "rollback"]
        return (f"{arm}: rolled back {s['rollbacks']} time(s) (at steps "
                f"{', '.join(map(str, at))}), replayed {s['replayed_steps']} steps, final loss "
                f"{s['final_loss']:.4f}.")  # fmt: skip
    if s["faults_detected"]:
        return (f"{arm}: {s['faults_corrected']} of {s['faults_detected']} detections "
                f"corrected in the step, {s['skipped']} step(s) skipped, no step lost, final "
                f"loss {s['final_loss']:.4f}.")  # fmt: skip
    return (
        f"{arm}: {s['faults_injected']} fault(s), none detected, final loss {s['final_loss']:.4f}."
    )


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
        _overhead_cell(arm, s), recovery,
    ]  # fmt: skip


# every arm runs the reference's steps and more (fault hooks, checkpoint saves, checks)
_PROBLEM = "measurement problem"


def _overhead_cell(arm: str, s: dict[str, Any]) -> str:
    """An overhead only with its interval, and none that contradicts the work done."""
    if arm == "reference":
        return ""
    if s["non_trainable"]:
        return "stopped"
    point, interval = s.get("overhead"), s.get("overhead_interval")
    if point is None or interval is None:  # too few rounds, or a summary from before intervals
        return "n/a"
    low, high = interval
    if high < 0:  # more work than the reference measured as less, in (almost) every round
        return _PROBLEM
    return f"{100 * point:+.0f}% [{100 * low:+.0f}, {100 * high:+.0f}]"


def overhead_note(summary: dict[str, Any]) -> str:
    """How the overhead column was measured, and what a measurement problem means."""
    timing = summary.get("timing")
    if timing is None:
        return ("Overhead: none shown (the arms of this run ran one after another, so load "
                "during one arm would show up as its overhead; rerun the demo).")  # fmt: skip
    note = (
        f"Overhead: the arms took turns ({timing['untimed_per_turn']} untimed + "
        f"{timing['timed_per_turn']} timed steps each, {timing['rounds']} rounds), so load hits "
        "every arm alike; the median over rounds of the arm's time in its turn (checks and "
        "checkpoint saves included) against the reference's in the same round [95% interval "
        "of that median; the range below 6 rounds]; none for an arm that stopped."
    )
    if any(_overhead_cell(a, summary[a]) == _PROBLEM for a in ARMS if a in summary):
        note += (
            f" A {_PROBLEM}: an arm that does the reference's work and more measured faster than "
            "it in nearly every round: the machine's load changed from turn to turn, so its "
            "figure says nothing of its cost; rerun on a quieter machine."
        )
    return note


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
        if k != "quarantine"
    )
    page = f"""<!doctype html><meta charset="utf-8"><title>attnchecker run</title>
<style>body{{font-family:sans-serif;max-width:50em;margin:2em auto}}td{{padding:.2em .6em;border-bottom:1px solid #ddd}}</style>
<h1>{html.escape(str(run))}</h1>{_quarantine(summary, meta=run / "meta.json")}<table>{items}</table>
<p>events: {html.escape(json.dumps(kinds))}</p><img src="loss.png" alt="loss">
"""
    path = run / "report.html"
    path.write_text(page)
    return path
