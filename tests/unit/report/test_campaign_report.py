"""report.campaign_report from hand-written trial files (two shards, one torn line): the rates
in its tables, the propagation table, the failures it lists and one self-contained page."""

from __future__ import annotations

import json

import pytest

from attnchecker.report import campaign_report, report, run_kind

PNG = b"\x89PNG\r\n\x1a\n"


def _trial(i, family, site, kind, pattern, unprotected, propagation, protected, result):
    return {"id": i, "family": family, "site": site, "layer": 0, "kind": kind,
            "pattern": pattern, "rep": 0, "seed": i, "schema_version": 1,
            "unprotected": {"outcome": unprotected, "propagation": propagation},
            "protected": {"outcome": protected, "result": result}}  # fmt: skip


def _prop(scores, context, out, next_input):
    return {"scores": scores, "context": context, "out": out, "next_input": next_input}


TRIALS = [
    _trial(0, "bert", "scores", "inf", "0D", "non_trainable", _prop("0D", "1R", "1R", "2D"),
           "masked", "corrected"),
    _trial(1, "bert", "scores", "inf", "0D", "masked", _prop("0D", "1R", "2D", "2D"),
           "masked", "recomputed"),
    _trial(2, "bert", "q", "nan", "2D", "loss_spike", _prop("2D", "2D", "2D", "2D"),
           "silent_deviation", "missed"),
    _trial(3, "gpt2", "scores", "nan", "0D", "non_trainable", _prop("0D", "1R", "1R", "2D"),
           "masked", "uncorrectable"),
]  # fmt: skip


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    out = tmp_path_factory.mktemp("campaign")
    shard0 = "".join(json.dumps(t) + "\n" for t in TRIALS[:3])
    (out / "trials.rank0.jsonl").write_text(shard0 + '{"id": 9, "fam')  # torn: interrupted
    (out / "trials.rank1.jsonl").write_text(json.dumps(TRIALS[3]) + "\n")
    page = campaign_report(out)
    return out, page, (out / "report.md").read_text()


def test_the_tables_have_each_cells_rates(campaign):
    _, _, md = campaign
    assert "4 trials from" in md  # the torn line is no trial
    # unprotected: trials, non-trainable, loss spike, silent deviation, masked
    assert "| bert | scores | inf | 2 | 50% | 0% | 0% | 50% |" in md
    assert "| bert | q | nan | 1 | 0% | 100% | 0% | 0% |" in md
    # protected: ..., corrected, recomputed, uncorrectable, missed, not needed, outcome masked
    assert "| bert | scores | inf | 2 | 0% | 50% | 50% | 0% | 0% | 0% | 100% |" in md
    assert "| gpt2 | scores | nan | 1 | 0% | 0% | 0% | 100% | 0% | 0% | 100% |" in md


def test_propagation_pools_one_element_faults_of_a_site(campaign):
    _, _, md = campaign
    # three 0D trials at the scores (bert twice, gpt2 once); the 2D fault at q is left out
    assert "| scores | 0D 100% | 1R 100% | 1R 67%, 2D 33% | 2D 100% |" in md
    assert "| q |" not in md.split("## Propagation")[1].split("##")[0]


def test_failures_are_the_unmasked_or_unrepaired_protected_trials(campaign):
    _, _, md = campaign
    assert "## Protected trials that were not masked or not repaired: 2" in md
    assert "- trial 2: bert q nan 2D seed 2 -> missed, silent_deviation" in md
    assert "- trial 3: gpt2 scores nan 0D seed 3 -> uncorrectable, masked" in md
    assert "trial 0:" not in md and "trial 1:" not in md


def test_the_page_is_self_contained(campaign):
    out, page, md = campaign
    assert page == out / "report.html"
    html = page.read_text()
    assert html.count("data:image/png;base64,") == md.count("](") == 2
    assert ".png)" not in html and 'src="heatmaps.png"' not in html
    assert "<table>" in html and "<td>bert</td>" in html
    for name in ("heatmaps.png", "non_trainable_by_site.png"):
        assert (out / name).read_bytes().startswith(PNG)


def test_report_finds_a_campaign_by_its_trial_files(campaign):
    out, _, _ = campaign
    assert run_kind(out) == "campaign" and report(out) == out / "report.html"
