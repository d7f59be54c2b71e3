"""A campaign's report from its files alone: ``report.md`` with tables and PNG plots."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from attnchecker.inject.campaign import load_trials, summarize

__all__ = ["campaign_report"]

_KEY_KINDS = ("inf", "nan", "near_inf", "exponent_flip")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _propagation(rows: list[dict[str, Any]]) -> list[str]:
    """The most frequent patterns per site and observation point: unprotected runs, one-element
    faults of the extreme kinds (the setting of the spec's propagation table)."""
    table = defaultdict(lambda: defaultdict(Counter))
    for r in rows:
        if r["pattern"] != "0D" or r["kind"] not in _KEY_KINDS:
            continue
        for where, pat in r["unprotected"]["propagation"].items():
            table[r["site"]][where][pat] += 1
    lines = [
        "| fault site | scores (AS) | context (CL) | output (O) | next layer input |",
        "|---|---|---|---|---|",
    ]
    for site, by in table.items():
        cells = []
        for where in ("scores", "context", "out", "next_input"):
            c = by[where]
            total = sum(c.values())
            top = ", ".join(f"{p} {_pct(n / total)}" for p, n in c.most_common(2))
            cells.append(top)
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    return lines


def campaign_report(out: str | Path) -> Path:
    """Write ``out/report.md`` and ``out/*.png`` from ``out/trials*.jsonl``; return the report path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    rows = load_trials(out)
    summary = summarize(out)
    cells = summary["cells"]
    unprot = [c for c in cells if c["arm"] == "unprotected"]
    prot = [c for c in cells if c["arm"] == "protected"]
    lines = [
        "# Fault-injection campaign",
        "",
        f"{summary['trials']} trials from `{out}` (each: the same short training fault-free, "
        "unprotected and protected; one fault at step 1 in the checked layer).",
        "",
        "## Unprotected: how often a fault makes training non-trainable",
        "",
        "| family | site | kind | trials | non-trainable | loss spike | silent deviation | masked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in unprot:
        lines.append(
            f"| {c['family']} | {c['site']} | {c['kind']} | {c['trials']} | {_pct(c['non_trainable_rate'])} | "
            f"{_pct(c['loss_spike_rate'])} | {_pct(c['silent_deviation_rate'])} | {_pct(c['masked_rate'])} |"
        )
    lines += [
        "",
        "## Protected",
        "",
        "| family | site | kind | trials | non-trainable | corrected | recomputed | uncorrectable | missed | not needed | outcome masked |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in prot:
        lines.append(
            f"| {c['family']} | {c['site']} | {c['kind']} | {c['trials']} | {_pct(c['non_trainable_rate'])} | "
            f"{_pct(c['corrected_rate'])} | {_pct(c['recomputed_rate'])} | {_pct(c['uncorrectable_rate'])} | "
            f"{_pct(c['missed_rate'])} | {_pct(c['not_needed_rate'])} | {_pct(c['masked_rate'])} |"
        )
    lines += [
        "",
        "## Propagation of one faulty element (unprotected; INF, NaN, near-INF, exponent flip)",
        "",
        "Pattern of the elements that differ from the fault-free run, in the matrix that differs "
        "most (`none`: the error never got there, e.g. a masked score).",
        "",
    ]
    lines += _propagation(rows)
    fails = summary["protected_failures"]
    lines += ["", f"## Protected trials that were not masked or not repaired: {len(fails)}", ""]
    lines += [
        f"- trial {f['id']}: {f['family']} {f['site']} {f['kind']} {f['pattern']} seed {f['seed']} -> {f['result']}, {f['outcome']}"
        for f in fails[:50]
    ]

    # Plot: non-trainable rate per site, unprotected vs protected, extreme kinds pooled.
    by_site: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        if c["kind"] in _KEY_KINDS:
            by_site[c["site"]][c["arm"]].append(c["non_trainable_rate"])
    sites = list(by_site)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for k, arm in enumerate(("unprotected", "protected")):
        vals = [sum(by_site[s][arm]) / max(len(by_site[s][arm]), 1) for s in sites]
        ax.bar([i + 0.4 * k for i in range(len(sites))], vals, width=0.4, label=arm)
    ax.set_xticks([i + 0.2 for i in range(len(sites))], sites)
    ax.set_ylabel("non-trainable rate")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("One extreme fault (INF, NaN, near-INF, exponent flip) per trial")
    fig.tight_layout()
    fig.savefig(out / "non_trainable_by_site.png", dpi=120)
    plt.close(fig)
    lines += ["", "![non-trainable rate by site](non_trainable_by_site.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
