"""A small campaign end to end: files, resume without loss or double counting, shards, report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnchecker import cli
from attnchecker.inject.campaign import (
    CampaignConfig,
    _setup,
    load_trials,
    run_campaign,
    summarize,
    trial_specs,
)

CFG = CampaignConfig(
    families=("gpt2",),
    sites=("q", "scores", "context"),
    kinds=("nan", "exponent_flip"),
    trials=2,
    steps=2,
)


def test_small_campaign_and_its_files(tmp_path):
    summary = run_campaign(CFG, tmp_path, progress=False)
    assert summary["trials"] == 12
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["config"]["families"] == ["gpt2"] and "torch" in meta["versions"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    cells = {(c["site"], c["kind"], c["arm"]): c for c in summary["cells"]}
    for site in ("q", "scores", "context"):
        nan_unprot = cells[(site, "nan", "unprotected")]
        assert nan_unprot["non_trainable_rate"] == 1.0  # a NaN in attention kills training
        for kind in ("nan", "exponent_flip"):
            c = cells[(site, kind, "protected")]
            assert c["non_trainable_rate"] == 0.0 and c["masked_rate"] == 1.0
            assert c["corrected_rate"] + c["recomputed_rate"] + c["not_needed_rate"] == 1.0
    q_nan = [r for r in load_trials(tmp_path) if r["site"] == "q" and r["kind"] == "nan"]
    assert {r["unprotected"]["propagation"]["scores"] for r in q_nan} == {"1R"}  # Q row -> AS row
    assert summary["protected_failures"] == []


def test_resume_after_interruption(tmp_path):
    specs = trial_specs(CFG)
    run_campaign(CampaignConfig(**{**CFG.to_dict(), "sites": ("q",)}), tmp_path, progress=False)
    path = tmp_path / "trials.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(
        "\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2]
    )  # killed mid-write
    summary = run_campaign(CFG, tmp_path, progress=False)
    ids = [r["id"] for r in load_trials(tmp_path)]
    assert sorted(ids) == [s["id"] for s in specs]  # every trial once, none lost
    assert summary["trials"] == len(specs)


def test_shards_merge_into_one_summary(tmp_path):
    for rank in (0, 1):
        run_campaign(
            CampaignConfig(**{**CFG.to_dict(), "rank": rank, "world": 2}), tmp_path, progress=False
        )
    assert sorted(p.name for p in tmp_path.glob("trials*.jsonl")) == [
        "trials.rank0.jsonl",
        "trials.rank1.jsonl",
    ]
    assert summarize(tmp_path)["trials"] == 12


def test_cli_campaign_and_report(tmp_path):
    args = [
        "campaign",
        "--out",
        str(tmp_path),
        "--families",
        "bert",
        "--sites",
        "v",
        "--kinds",
        "inf",
        "--steps",
        "1",
    ]
    assert cli.main(args) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| bert | v | inf | 1 |" in report and (tmp_path / "non_trainable_by_site.png").exists()
    assert (tmp_path / "heatmaps.png").exists()
    page = (tmp_path / "report.html").read_text()  # one file: tables, images embedded
    assert "<table>" in page and page.count("data:image/png;base64,") == 2
    assert cli.main(["report", str(tmp_path)]) == 0


def test_cli_campaign_runs_the_new_families(tmp_path):
    """Any model type of the family table: an encoder-decoder and a q_norm / k_norm decoder."""
    args = ["campaign", "--out", str(tmp_path), "--families", "bart", "qwen3", "--sites", "k",
            "--kinds", "nan", "--steps", "1"]  # fmt: skip
    assert cli.main(args) == 0
    rows = {r["family"]: r for r in load_trials(tmp_path)}
    for family in ("bart", "qwen3"):
        assert rows[family]["protected"]["outcome"] == "masked"
        assert rows[family]["unprotected"]["outcome"] == "non_trainable"


def test_a_campaign_on_a_model_of_ones_own(tmp_path):
    """A factory (package.module:function) as a campaign's family: its projections found by a
    traced forward; faults at a projection and in the core kill the unprotected run and are
    corrected in the protected one."""
    factory = "tests.integration.sdpa_models:nanogpt"
    args = ["campaign", "--out", str(tmp_path), "--families", factory, "--sites", "v", "scores",
            "--kinds", "nan", "--steps", "2"]  # fmt: skip
    assert cli.main(args) == 0
    rows = load_trials(tmp_path)
    assert {r["site"] for r in rows} == {"v", "scores"} and {r["family"] for r in rows} == {factory}
    for r in rows:
        assert r["unprotected"]["outcome"] == "non_trainable", r
        assert r["protected"]["outcome"] == "masked" and r["protected"]["result"] == "corrected", r


def test_cli_takes_its_shard_from_torchrun_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = [
        "campaign",
        "--out",
        str(tmp_path),
        "--families",
        "gpt2",
        "--sites",
        "q",
        "v",
        "--kinds",
        "nan",
        "--steps",
        "1",
    ]
    assert cli.main(args) == 0
    assert [p.name for p in tmp_path.glob("trials*.jsonl")] == ["trials.rank1.jsonl"]
    assert [r["id"] for r in load_trials(tmp_path)] == [1]


def test_a_second_campaign_in_one_process_gets_its_own_setup(tmp_path):
    """Workers cache their model, batches and reference run: the cache is keyed on everything
    that defines them, so a second campaign in the same process never reuses the first's."""
    first = dataclasses.replace(CFG, sites=("q",), kinds=("nan",), trials=1)
    second = dataclasses.replace(first, seq_len=16, lr=3e-3)
    run_campaign(first, tmp_path / "a", progress=False)
    run_campaign(second, tmp_path / "b", progress=False)
    ref_a = {r["ref_final_loss"] for r in load_trials(tmp_path / "a")}
    ref_b = {r["ref_final_loss"] for r in load_trials(tmp_path / "b")}
    assert ref_a != ref_b
    setup = _setup(second, "gpt2", second.layer)
    assert setup.batches[0]["input_ids"].shape == (second.batch, 16) and setup.lr == 3e-3


@pytest.mark.slow  # 30 s
def test_campaign_on_the_fused_backend(tmp_path):
    """The same campaign on backend="triton": kernel sites of the forward and the backward; the
    unprotected arm runs the kernels unchecked and dies, the protected one is corrected."""
    import pytest

    from attnchecker.kernels import available

    if not available():
        pytest.skip("needs triton (CUDA or the interpreter)")
    cfg = CampaignConfig(families=("llama",), sites=("kernel:s", "kernel:dq"),
                         kinds=("nan",), steps=1, backend="triton")  # fmt: skip
    run_campaign(cfg, tmp_path, progress=False)
    rows = {r["site"]: r for r in load_trials(tmp_path)}
    for site in cfg.sites:
        assert rows[site]["unprotected"]["outcome"] == "non_trainable", site
        assert rows[site]["protected"]["outcome"] == "masked", site
        assert rows[site]["protected"]["detected_at_site"], site


def test_kernel_sites_need_the_fused_backend():
    import pytest

    from attnchecker.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown sites"):
        CampaignConfig(sites=("kernel:s",))


def test_check_arms_measure_what_each_check_covers(tmp_path):
    """With check arms every non-trainable trial reruns with each check alone in each layer
    under skip_step: its own check corrects it; a check downstream of a forward fault (in its
    layer, a later one, or any backward check) detects what it cannot correct and the guard
    skips that update, so training goes on (a skipped step's NaN loss is not the model's); a
    check that runs before the fault cannot help (not run: a forward check for a backward
    fault, a forward check of an earlier layer, a backward check of a later one), and one
    upstream in the same layer does not. The profile turns them into rates under any set of
    checks, named relative to the fault's layer."""
    import pytest

    from attnchecker.adaptive.profile import VulnerabilityProfile
    from attnchecker.errors import ConfigError

    cfg = CampaignConfig(families=("gpt2",), sites=("q", "scores", "dq"), kinds=("nan",),
                         layers=(0, 1), check_arms=True)  # fmt: skip
    run_campaign(cfg, tmp_path, progress=False)
    rows = {(r["site"], r["layer"]): r for r in load_trials(tmp_path)}
    assert all(r["unprotected"]["outcome"] == "non_trainable" for r in rows.values())
    q, scores, dq = (rows[s, 0]["checks"] for s in ("q", "scores", "dq"))
    every = {f"{c}@{at}" for c in ("q", "scores", "dq") for at in (0, 1)}
    assert set(q) == set(scores) == every and set(dq) == {"dq@0"}  # dq@1 ran before the fault
    assert set(rows["q", 1]["checks"]) == every - {"q@0", "scores@0"}  # layer 0 ran before
    for site, arms in (("q", q), ("scores", scores), ("dq", dq)):
        assert arms[f"{site}@0"]["outcome"] == "masked"
        assert arms[f"{site}@0"]["result"] == "corrected"
    assert q["scores@0"]["outcome"] == "silent_deviation" and q["scores@0"]["skipped"] == 1
    assert q["q@1"]["outcome"] == "silent_deviation"  # the next layer's check sees it
    assert rows["q", 1]["checks"]["dq@0"]["outcome"] == "silent_deviation"  # through the loss
    assert scores["q@0"]["outcome"] == "non_trainable"  # q's check ran before the fault
    vuln = VulnerabilityProfile.from_campaign(tmp_path)
    cell = vuln.cell("q", 1, "nan")[0]
    assert set(cell.checks) == {f"{c}@{d}" for c in ("q", "scores", "dq") for d in ("+0", "-1")}
    assert cell.rate_with(frozenset()).point == 1.0
    assert cell.rate_with(frozenset({"dq@-1"})).point == 0.0  # covered a layer before
    assert cell.rate_with(frozenset({"q@-1"})).point == 1.0  # ran before it: not run, lost
    assert vuln.cell("scores", 0, "nan")[0].rate_with(frozenset({"q@+0"})).point == 1.0
    assert VulnerabilityProfile.from_dict(vuln.to_dict()) == vuln
    with pytest.raises(ConfigError, match="check arms"):
        CampaignConfig(sites=("kernel:s",), backend="triton", check_arms=True)
