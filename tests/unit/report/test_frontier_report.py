"""report.adaptive from hand-made simulations: each point's row (the count against its predicted
interval, the overhead against its prediction) and the report rebuilt from frontier.json alone."""

from __future__ import annotations

import json

from attnchecker.adaptive.profile import Estimate
from attnchecker.adaptive.simulate import Simulation
from attnchecker.report import report, run_kind
from attnchecker.report.adaptive import frontier_report, frontier_rows

PNG = b"\x89PNG\r\n\x1a\n"


def _sim(budget, events, interval, overhead, predicted, checks=()):
    return Simulation(
        budget=budget, checks=checks, steps=200, faults=40, events=events,
        predicted_events=Estimate(float(sum(interval)) / 2, 0.0, 30.0),
        events_interval=interval, overhead=Estimate(*overhead),
        predicted_overhead=Estimate(*predicted), seconds=1.5,
    )  # fmt: skip


SIMS = [
    _sim(None, 12, (8, 20), (0.0, -0.01, 0.01), (0.0, -0.02, 0.02)),  # nothing checked: inside
    _sim(0.05, 0, (1, 6), (0.04, 0.03, 0.05), (0.05, 0.045, 0.06), ((0, "scores", 1),)),
    _sim(0.5, 9, (0, 3), (0.3, 0.25, 0.35), (0.2, 0.1, 0.28), ((0, "q", 1), (1, "q", 2))),
]


def test_each_row_states_the_verdicts():
    rows = frontier_rows(SIMS)
    assert rows[0].startswith("| budget | checks |") and len(rows) == 2 + len(SIMS)
    assert rows[2] == ("| none | 0 | 40 | 12 | 14.0 [8, 20] | inside | +0.0% [-1.0%, +1.0%] "
                       "| +0.0% [-2.0%, +2.0%] | yes |")  # fmt: skip
    assert rows[3].startswith("| 5% | 1 | 40 | 0 | 3.5 [1, 6] | below |")
    assert rows[3].endswith("| NO |")  # 4% measured, 4.5% .. 6% predicted
    assert rows[4].startswith("| 50% | 2 | 40 | 9 | 1.5 [0, 3] | ABOVE |")
    assert rows[4].endswith("| NO |")


def test_the_frontier_is_rebuilt_from_its_json_alone(tmp_path):
    meta = {"family": "gpt2", "rate": "1e-9 per element"}
    md = frontier_report(SIMS, tmp_path, meta)
    assert md == tmp_path / "frontier.md" and run_kind(tmp_path) == "frontier"
    text = md.read_text()
    assert text.startswith("# Adaptive protection: the frontier (gpt2)")
    assert "Fault rate 1e-9 per element, 200 steps per point." in text
    assert "\n".join(frontier_rows(SIMS)) in text and "![frontier](frontier.png)" in text
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["meta"] == meta and [p["verdict"] for p in saved["points"]] == [
        "inside", "below", "ABOVE"
    ]  # fmt: skip
    (tmp_path / "frontier.md").unlink()
    (tmp_path / "frontier.png").unlink()
    assert report(tmp_path) == md and md.read_text() == text
    assert (tmp_path / "frontier.png").read_bytes().startswith(PNG)
