"""SDC lockstep in one process: the determinism gate and the study's shape at three levels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnchecker import cli
from attnchecker.models.families import FAMILIES
from attnchecker.models.tiny import build
from attnchecker.sdc import STUDY_NODE, LockstepConfig, SDCModel, boundaries, run_lockstep


@pytest.fixture
def text(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text(
        "To be, or not to be, that is the question; whether tis nobler.\n" * 500
    )
    return (str(tmp_path / "t"),)


@pytest.mark.parametrize("family", FAMILIES)
def test_boundaries_of_every_family(family):
    model = build(family)
    stacks = 2 if model.config.is_encoder_decoder else 1  # BART: the encoder's, the decoder's
    sites = boundaries(model)
    assert [(layer, kind) for _, layer, kind, _ in sites] == [
        (0, "attention"),
        (0, "mlp"),
        (1, "attention"),
        (1, "mlp"),
    ] * stacks


def test_corruption_rate_and_severity_are_as_configured():
    model = SDCModel(rate=0.01, log_rel_min=-3, log_rel_max=-3, tail=0.0)
    t = torch.ones(100_000)
    hits = model.corrupt_(t, site_rate=0.01, generator=torch.Generator().manual_seed(0))
    changed = (t != 1).sum().item()
    assert 800 < hits < 1200 and changed <= hits
    assert torch.allclose((t[t != 1] - 1).abs(), torch.full((changed,), 1e-3), rtol=1e-3)
    assert not SDCModel(onset=5).active(4) and SDCModel(onset=5).active(5)
    assert [SDCModel(burst=2, gap=3).active(s) for s in range(1, 8)] == [
        True,
        True,
        False,
        False,
        False,
        True,
        True,
    ]


def test_level1_gate_and_isolation(text, tmp_path):
    s = run_lockstep(LockstepConfig(level=1, steps=4, data=text), tmp_path / "l1")
    assert s["gate_mismatches"] == 0 and s["deterministic"]
    assert 1e-7 <= s["mismatch_frequency"] <= 3e-2  # the study's range
    rows = [json.loads(x) for x in (tmp_path / "l1" / "steps.jsonl").read_text().splitlines()]
    assert {r["direction"] for r in rows} == {"forward", "backward"}
    assert {r["submodule"] for r in rows} == {"attention", "mlp"}
    clean = run_lockstep(
        LockstepConfig(level=1, steps=2, data=text, sdc=SDCModel(rate=0, mlp_rate=0)),
        tmp_path / "c",
    )
    assert clean["mismatch_frequency"] == 0.0  # no fault model: the replicas agree bit for bit


def test_level2_and_level3_shape(text, tmp_path):
    s2 = run_lockstep(LockstepConfig(level=2, steps=20, data=text, sdc=STUDY_NODE), tmp_path / "l2")
    assert 1e-3 < s2["worst_gradient_nsr"] < 0.2  # a few percent
    s3 = run_lockstep(LockstepConfig(level=3, steps=20, data=text), tmp_path / "l3")
    assert s3["final_param_drift"] > 0  # the weights moved apart ...
    assert s3["final_loss"]["faulty"] == pytest.approx(
        s3["final_loss"]["healthy"], rel=1e-3
    )  # ... loss did not
    assert s3["control_param_drift"] > 0 and "control_prediction_divergence" in s3


def test_cli_sdc_lockstep(text, tmp_path):
    assert (
        cli.main(
            [
                "sdc",
                "lockstep",
                "--level",
                "2",
                "--steps",
                "3",
                "--out",
                str(tmp_path / "o"),
                "--data",
                *text,
            ]
        )
        == 0
    )
    assert "worst_gradient_nsr" in json.loads((tmp_path / "o" / "summary.json").read_text())
    assert (tmp_path / "o" / "report.html").exists() and (tmp_path / "o" / "level2.png").exists()
    assert cli.main(["report", str(tmp_path / "o")]) == 0


def test_record_and_compare_from_files(text, tmp_path, capsys):
    a, b, c = (str(tmp_path / f"{n}.jsonl") for n in "abc")
    base = ["sdc", "record", "--steps", "3", "--data", *text]
    assert cli.main([*base, "--out", a]) == 0
    assert cli.main([*base, "--out", b]) == 0
    assert cli.main([*base, "--out", c, "--faulty"]) == 0
    capsys.readouterr()
    assert cli.main(["sdc", "compare", a, b]) == 0  # two healthy runs: identical, exit 0
    assert capsys.readouterr().out.startswith("identical: 24 fingerprints compared")
    assert cli.main(["sdc", "compare", a, c]) == 1
    said = capsys.readouterr().out  # the answer first, in words
    assert said.startswith("first divergence: step 1, ") and "max relative norm drift" in said
    assert cli.main(["sdc", "compare", a, c, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["first_divergence"]["step"] == 1
    from attnchecker.sdc.fingerprint import compare

    ac, ca = compare(a, c), compare(c, a)
    assert ac["first_divergence"] == ca["first_divergence"] and ac["first_divergence"]["step"] == 1
    assert ac["compared"] == 3 * 4 * 2  # steps x boundaries x (forward, backward)
    line = json.loads(Path(a).read_text().splitlines()[0])
    assert {"sum", "norm", "absmax", "nonfinite", "hash"} <= set(line)


@pytest.mark.distributed
@pytest.mark.parametrize(  # the levels share the two-rank transport: one runs by default (30 s
    "level",  # each on 2 cores), the others in the slow set; each level in one process above
    [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)],
)
def test_two_ranks_match_one_process(text, tmp_path, level):
    args = ["sdc", "lockstep", "--level", str(level), "--steps", "3", "--data", *text]
    assert cli.main([*args, "--out", str(tmp_path / "one")]) == 0
    assert cli.main([*args, "--out", str(tmp_path / "two"), "--nproc", "2"]) == 0
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["mode"] == "two_ranks" and two["gate_mismatches"] == 0
    keys = {
        1: ["mismatch_frequency", "mismatch_severity"],
        2: ["worst_gradient_nsr", "mean_gradient_nsr"],
        3: ["final_param_drift", "control_param_drift", "prediction_divergence"],
    }[level]
    for k in keys:
        assert two[k] == pytest.approx(one[k], rel=1e-6, abs=1e-12), k


def test_detectors_side_by_side(text):
    from attnchecker.sdc.detectors import DetectorTrial, run_detectors

    r = run_detectors(DetectorTrial(steps=4, onset=2, replica_every=2, data=text))
    assert r["step_replay"]["detected"] and r["abft"]["detected"] and r["replica_check"]["detected"]
    assert r["abft"]["latency_steps"] == 0
    assert not r["loss_check"]["detected"]  # small SDC does not move the loss: the study's point
    assert not any(v["false_alarm"] for v in r.values())
