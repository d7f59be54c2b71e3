"""report.run_kind / report.report: which run a directory holds, decided from its files."""

import json

import pytest

from attnchecker.errors import ConfigError
from attnchecker.report import RUN_KINDS, report, run_kind

LAYOUTS = {  # the files that make each kind, as the commands write them
    "campaign": ["trials.rank0.jsonl"],
    "demo": ["summary.json", "reference/"],
    "frontier": ["frontier.json"],
    "training": ["metrics.jsonl"],
    "sdc": ["steps.jsonl", "summary.json"],
}


def _make(root, files):
    for f in files:
        if f.endswith("/"):
            (root / f).mkdir()
        else:
            (root / f).write_text("{}\n")


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_each_kind_is_told_by_its_files(kind, tmp_path):
    _make(tmp_path, LAYOUTS[kind])
    assert run_kind(tmp_path) == kind


def test_a_demo_is_not_taken_for_an_sdc_run(tmp_path):
    """Both write summary.json; the demo's reference arm decides."""
    _make(tmp_path, ["summary.json", "steps.jsonl", "reference/"])
    assert run_kind(tmp_path) == "demo"


def test_an_empty_directory_is_refused_by_name(tmp_path):
    assert run_kind(tmp_path) is None
    with pytest.raises(ConfigError, match="not a campaign, demo or training run"):
        report(tmp_path)


def test_a_training_run_gets_its_report(tmp_path):
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "step_seconds": 0.1} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "meta.json").write_text(json.dumps({"config": {}}))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    out = report(tmp_path)
    assert out.exists() and out.suffix == ".html"
