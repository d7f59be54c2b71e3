"""report.adaptive from a hand-made validation: each row's verdicts (the seeds' counts against
the predictive interval, the overhead against its budget and prediction), the coverage, the
gains, the misses with the exit status, and the report rebuilt from frontier.json alone."""

from __future__ import annotations

import json

import pytest

from attnchecker.adaptive.profile import Estimate
from attnchecker.adaptive.simulate import Condition, Run
from attnchecker.adaptive.validate import Gain, Prediction, Row, Validation
from attnchecker.errors import ConfigError
from attnchecker.report import report, run_kind
from attnchecker.report.adaptive import frontier_report, frontier_rows

PNG = b"\x89PNG\r\n\x1a\n"


def _row(name, kind, budget, events, interval, overhead, predicted, checks=()):
    runs = tuple(Run(i, 40, e, 0) for i, e in enumerate(events))
    return Row(name, kind, budget, checks, Condition(), 200, runs,
               Prediction(float(sum(interval)) / 2, *interval, 0.9), Estimate(*overhead),
               Estimate(*predicted), 1.5)  # fmt: skip


ROWS = (
    _row("none", "in-sample", None, [12, 9, 15], (8, 20), (0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    _row(
        "budget 5%",
        "in-sample",
        0.05,
        [0, 0, 0],
        (1, 6),
        (0.04, 0.03, 0.05),
        (0.05, 0.045, 0.06),
        ((0, "scores", 1),),
    ),
    _row(
        "budget 50%",
        "in-sample",
        0.5,
        [9, 7, 8],
        (0, 3),
        (0.6, 0.55, 0.65),
        (0.2, 0.1, 0.28),
        ((0, "q", 1), (1, "q", 2)),
    ),
)
VAL = Validation(ROWS, (Gain("every check at 5%", (2, 3, 1)),), 0.9)


def test_each_row_states_the_verdicts():
    rows = frontier_rows(VAL)
    assert rows[0].startswith("| row | checks |")
    assert rows[2] == ("| none | 0 | 40 | 12, 9, 15 | 14.0 [8, 20] | 3 of 3 | inside | 0, 0, 0 | "
                       "+0.0% [+0.0%, +0.0%] | +0.0% [+0.0%, +0.0%] | inside |")  # fmt: skip
    assert rows[3].startswith("| budget 5% | 1 | 40 | 0, 0, 0 | 3.5 [1, 6] | 0 of 3 | BELOW |")
    assert rows[3].endswith("| BELOW |")  # 4% measured, 4.5% .. 6% predicted
    assert rows[4].startswith("| budget 50% | 2 | 40 | 9, 7, 8 | 1.5 [0, 3] | 0 of 3 | ABOVE |")
    assert rows[4].endswith("| OVER BUDGET |")
    text = "\n".join(rows)
    assert "**Coverage: 3 of 9 counts inside their 90% predictive intervals**" in text
    assert "| every check at 5% | 2, 3, 1 | +2.0 [" in text
    assert "exit status 1" in text and "budget 50%: overhead +60.0% [" in text
    assert "OVER BUDGET (budget 50%, upper end)" in text


def test_the_frontier_is_rebuilt_from_its_json_alone(tmp_path):
    meta = {"family": "gpt2", "rate": "1e-9 per element"}
    md = frontier_report(VAL, tmp_path, meta)
    assert md == tmp_path / "frontier.md" and run_kind(tmp_path) == "frontier"
    text = md.read_text()
    assert text.startswith("# Adaptive protection: validation (gpt2)")
    assert "Fault rate 1e-9 per element, 200 steps per run, 3 seeds per row" in text
    assert "\n".join(frontier_rows(VAL)) in text and "![frontier](frontier.png)" in text
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["meta"] == meta and saved["status"] == 1
    assert [r["count_verdict"] for r in saved["rows"]] == ["inside", "BELOW", "ABOVE"]
    (tmp_path / "frontier.md").unlink()
    (tmp_path / "frontier.png").unlink()
    assert report(tmp_path) == md and md.read_text() == text
    assert (tmp_path / "frontier.png").read_bytes().startswith(PNG)


def test_an_older_frontier_is_refused_with_a_clear_error(tmp_path):
    """The one-seed frontier.json of before 2026-12-04 (``points``) is not rebuilt: a one-line
    error that says what to do, not a traceback."""
    (tmp_path / "frontier.json").write_text(json.dumps({"meta": {}, "points": []}))
    with pytest.raises(ConfigError, match="older frontier"):
        report(tmp_path)
