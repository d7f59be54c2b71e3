"""Two real processes under torchrun (gloo): a fault on one rank is repaired before the gradient
all-reduce, so both ranks end with the same parameters as a fault-free two-rank run. The faulty
run takes the SDPA route (``--backend sdpa``, the CUDA default; the CPU's flash kernel here),
the clean one the CPU default (the eager engine): the route under DDP ends where the fault-free
run does."""

from __future__ import annotations

import pytest
import torch

from attnchecker import cli
from attnchecker.inject import FaultPlan

pytestmark = pytest.mark.distributed


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_two_ranks_stay_identical_and_equal_to_fault_free(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "t.txt").write_text("To be, or not to be, that is the question.\n" * 400)
    plan = FaultPlan.builder().at(2).site("scores", layer=0).kind("nan").pattern("1R").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    common = ["train", "--nproc", "2", "--steps", "3", "--batch", "2", "--seq-len", "32"]
    common += ["--data", str(tmp_path / "texts"), "--protect"]
    assert cli.main([*common, "--out", str(tmp_path / "clean")]) == 0
    assert (
        cli.main(
            [
                *common,
                "--out",
                str(tmp_path / "faulty"),
                "--faults",
                str(tmp_path / "plan.json"),
                "--fault-rank",
                "1",
                "--backend",
                "sdpa",
            ]
        )
        == 0
    )
    runs = {
        name: [
            _weights(tmp_path / name / "model.safetensors"),
            _weights(tmp_path / name / "rank1" / "model.safetensors"),
        ]
        for name in ("clean", "faulty")
    }
    for k, v in runs["faulty"][0].items():
        assert torch.equal(v, runs["faulty"][1][k]), k  # ranks identical
        assert torch.allclose(v, runs["clean"][0][k], atol=1e-5), k  # and equal to fault-free
    import json

    events = (tmp_path / "faulty" / "rank1" / "events.jsonl").read_text()  # the faulty rank's
    assert '"type": "fault"' in events and '"action": "corrected"' in events
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert not summary["non_trainable"]
    # the diagnosis: rank 1's computation fault, named; rank 0 clean
    assert '"type": "diagnosis"' in events and '"cause": "fault"' in events
    assert [(r["rank"], r["faults"]) for r in summary["ranks"]] == [(0, 0), (1, 1)]
    [named] = summary["outlier_ranks"]
    assert named.startswith("rank 1, host ")
    assert named.endswith(": 1 corrected fault(s) in 3 steps; others 0")


def test_two_ranks_roll_back_together(tmp_path, monkeypatch):
    """Unprotected, with checkpoint/restore: a NaN on rank 0 sends both ranks back to the same
    checkpoint; after the replay they match the fault-free two-rank run."""
    import json

    monkeypatch.setenv("ATTNCHECKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "t.txt").write_text(
        "Now is the winter of our discontent made glorious summer.\n" * 400
    )
    plan = FaultPlan.builder().at(3).site("context", layer=1).kind("nan").add().build()
    (tmp_path / "plan.json").write_text(plan.to_json())
    common = [
        "train",
        "--nproc",
        "2",
        "--steps",
        "4",
        "--batch",
        "2",
        "--seq-len",
        "32",
        "--data",
        str(tmp_path / "texts"),
    ]
    common += ["--recovery", "checkpoint", "--checkpoint-every", "2"]
    assert cli.main([*common, "--out", str(tmp_path / "clean")]) == 0
    assert (
        cli.main(
            [
                *common,
                "--out",
                str(tmp_path / "faulty"),
                "--faults",
                str(tmp_path / "plan.json"),
                "--fault-rank",
                "1",
                "--backend",
                "sdpa",
            ]
        )
        == 0
    )
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert summary["rollbacks"] == 1 and not summary["non_trainable"]
    clean = _weights(tmp_path / "clean" / "model.safetensors")
    for rank_file in (
        tmp_path / "faulty" / "model.safetensors",
        tmp_path / "faulty" / "rank1" / "model.safetensors",
    ):
        for k, v in _weights(rank_file).items():
            assert torch.allclose(v, clean[k], atol=1e-6), k
