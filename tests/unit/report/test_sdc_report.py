"""report.sdc_report from hand-written lockstep run files, one per level (and level 3 as the
two-rank mode writes it): the plot of the level, the summary table, escaped."""

from __future__ import annotations

import json

import pytest

from attnchecker.report import report, run_kind
from attnchecker.report.sdc import sdc_report

PNG = b"\x89PNG\r\n\x1a\n"


def _level1_rows():
    return [
        {"step": s, "module": f"model.layers.{layer}.{kind}", "layer": layer, "submodule": kind,
         "direction": d, "elements": 1000, "mismatches": s * layer, "severity": 0.1}
        for s in (1, 2, 3) for layer in (0, 1) for kind in ("attention", "mlp")
        for d in ("forward", "backward")
    ]  # fmt: skip


ROWS = {
    1: _level1_rows(),
    2: [{"step": s, "gradient_nsr": 0.01 * s, "cosine": 1 - 1e-4 * s} for s in (1, 2, 3)],
    3: [{"step": s, "healthy": 5.0 - s, "faulty": 5.0 - s, "control": 5.1 - s,
         "drift": 0.0 if s == 1 else 1e-3 * s, "control_drift": 0.1 * s} for s in (1, 2, 3)],
    "3-two-ranks": [{"step": s, "loss": 5.0 - s, "drift": 1e-3 * s} for s in (1, 2)],
}  # fmt: skip


def _run(tmp_path, key):
    level = int(str(key)[0])
    out = tmp_path / f"run{key}"
    out.mkdir()
    summary = {"level": level, "mode": "<one process>", "gate_mismatches": 0,
               "per_layer_drift": {"model.layers.0": 0.123456789}}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[key]) + "\n")
    return out, level


@pytest.mark.parametrize("key", list(ROWS))
def test_each_level_gets_its_plot_and_its_summary(tmp_path, key):
    out, level = _run(tmp_path, key)
    assert run_kind(out) == "sdc"
    page = sdc_report(out)
    assert page == out / "report.html"
    html = page.read_text()
    assert f"<h1>SDC lockstep, level {level}</h1>" in html
    assert f'<img src="level{level}.png"' in html
    assert (out / f"level{level}.png").read_bytes().startswith(PNG)
    # every summary key but the per-layer drift, values as JSON and escaped
    assert "<td>gate_mismatches</td><td>0</td>" in html
    assert "&quot;&lt;one process&gt;&quot;" in html and "<one process>" not in html
    assert "per_layer_drift" not in html and "0.123456789" not in html
    assert report(out) == page  # the dispatcher builds the same report
