"""A campaign's report from its files alone: ``report.md`` with tables and PNG plots, and the
same as one self-contained ``report.html`` (images embedded), with heatmaps of the
non-trainable and repair rates per family x site x kind."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from attnchecker.inject.campaign import RECOVERY_ARMS, load_trials, summarize
from attnchecker.inject.kinds import DEFAULT_KINDS
from attnchecker.inject.trial import USER_OUTCOMES

__all__ = ["campaign_report"]

_KEY_KINDS = DEFAULT_KINDS


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


def _recovery(cells: list[dict]) -> list[str]:
    """The recovery arms: each fault as the user meets it, per arm (pooled over sites)."""
    if not cells:
        return []
    lines = [
        "",
        "## As the user meets a fault: the guard alone and protection, skipping or replaying",
        "",
        "Share of trials per outcome, over the sites and kinds above (each site and kind with "
        "its trials; `attnchecker plan` weighs them by the GEMMs' work and prices them).",
        "",
        "| arm | kind | trials | " + " | ".join(o.replace("_", " ") for o in USER_OUTCOMES) + " |",
        "|---|---|---|" + "---|" * len(USER_OUTCOMES),
    ]
    for arm in RECOVERY_ARMS:
        for kind in sorted({c["kind"] for c in cells}):
            mine = [c for c in cells if c["arm"] == arm and c["kind"] == kind]
            n = sum(c["trials"] for c in mine)
            if not n:
                continue
            shares = [
                sum(c["user_rates"][o] * c["trials"] for c in mine) / n for o in USER_OUTCOMES
            ]
            lines.append(f"| {arm} | {kind} | {n} | " + " | ".join(_pct(x) for x in shares) + " |")
    return lines


def campaign_report(out: str | Path) -> Path:
    """Write ``out/report.md``, ``out/*.png`` and ``out/report.html`` from
    ``out/trials*.jsonl``; return the HTML report's path."""
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
    lines += _recovery(summary.get("recovery", []))
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
        bars = ax.bar([i + 0.4 * k for i in range(len(sites))], vals, width=0.4, label=arm)
        ax.bar_label(bars, labels=[f"{100 * v:.0f}%" for v in vals], fontsize=8)
    ax.set_xticks([i + 0.2 for i in range(len(sites))], sites)
    ax.set_ylabel("non-trainable rate")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("One extreme fault (INF, NaN, near-INF, exponent flip) per trial")
    fig.tight_layout()
    fig.savefig(out / "non_trainable_by_site.png", dpi=120)
    plt.close(fig)
    lines += ["", "![non-trainable rate by site](non_trainable_by_site.png)", ""]
    _heatmaps(cells, out / "heatmaps.png")
    lines[4:4] = [
        "## At a glance: family x site x kind",
        "",
        "Left: how often one fault makes training non-trainable without protection; middle: the "
        "same with protection; right: how often protection repaired it (corrected, recomputed, "
        "or masked without a repair needed).",
        "",
        "![heatmaps](heatmaps.png)",
        "",
    ]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    path = out / "report.html"
    path.write_text(_html(text, out, title="attnchecker campaign"))
    return path


def _heatmaps(cells: list[dict[str, Any]], path: Path) -> None:
    """Per family: sites x kinds of the unprotected and protected non-trainable rates and of
    the protected repair rate, annotated."""
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(c["family"] for c in cells))
    sites = list(dict.fromkeys(c["site"] for c in cells))
    kinds = list(dict.fromkeys(c["kind"] for c in cells))
    panels = (
        ("unprotected", "non_trainable_rate", "non-trainable, unprotected", "Reds"),
        ("protected", "non_trainable_rate", "non-trainable, protected", "Reds"),
        ("protected", None, "repaired or not needed, protected", "Greens"),
    )
    fig, axes = plt.subplots(
        len(families), 3, figsize=(3.2 * 3, 0.45 * len(sites) * len(families) + 1.2),
        squeeze=False,
    )  # fmt: skip
    for r, fam in enumerate(families):
        for c, (arm, key, title, cmap) in enumerate(panels):
            grid = [[float("nan")] * len(kinds) for _ in sites]
            for cell in cells:
                if cell["family"] != fam or cell["arm"] != arm:
                    continue
                v = cell[key] if key else sum(
                    cell.get(k, 0.0) for k in ("corrected_rate", "recomputed_rate", "not_needed_rate")
                )  # fmt: skip
                grid[sites.index(cell["site"])][kinds.index(cell["kind"])] = v
            ax = axes[r][c]
            ax.imshow(grid, vmin=0, vmax=1, cmap=cmap, aspect="auto")
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    if v == v:
                        ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                                color="white" if v > 0.6 else "black")  # fmt: skip
            ax.set_xticks(range(len(kinds)), kinds, rotation=45, ha="right", fontsize=7)
            ax.set_yticks(range(len(sites)), sites if c == 0 else [], fontsize=7)
            ax.set_title(f"{fam}: {title}" if r == 0 or c == 0 else fam, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _html(text: str, out: Path, *, title: str) -> str:
    """One self-contained page from the report's markdown: tables, and images embedded."""
    import base64
    import re

    import markdown

    def embed(m: re.Match) -> str:
        data = base64.b64encode((out / m.group(2)).read_bytes()).decode()
        return f"![{m.group(1)}](data:image/png;base64,{data})"

    body = markdown.markdown(re.sub(r"!\[([^]]*)\]\(([^)]+\.png)\)", embed, text),
                             extensions=["tables"])  # fmt: skip
    style = ("body{font-family:sans-serif;max-width:70em;margin:2em auto}"
             "td,th{padding:.2em .6em;border-bottom:1px solid #ddd}img{max-width:100%}")  # fmt: skip
    return (f'<!doctype html><meta charset="utf-8"><title>{title}</title>'
            f"<style>{style}</style>{body}")  # fmt: skip
