"""report.training from hand-written run directories: the demo's page (each arm's story, the
table, the plan, protection's events, the diagnosis section) and one training run's page."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from attnchecker.report import report, run_kind
from attnchecker.report.training import (
    ARMS,
    COLUMNS,
    arm_row,
    demo_report,
    read_metrics,
    run_report,
)

PNG = b"\x89PNG\r\n\x1a\n"


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _arm(**kw) -> dict:
    s = {"faults_injected": 2, "faults_detected": 0, "faults_corrected": 0, "final_loss": 2.0,
         "non_trainable": False, "wall_time_s": 3.0, "save_s": 0.0, "load_s": 0.0, "saves": 0,
         "rollbacks": 0, "replayed_steps": 0, "skipped": 0, "steps_done": 6, "overhead": None,
         "overhead_interval": None}  # fmt: skip
    return s | kw


def _losses(arm: str, losses: list[float], out: Path) -> None:
    _jsonl(out / arm / "metrics.jsonl", [{"step": i + 1, "loss": x} for i, x in enumerate(losses)])


@pytest.fixture
def demo(tmp_path):
    out = tmp_path
    summary = {
        "description": "tiny <gpt2>, 6 steps",
        "faults": [{"step": 2, "site": "scores", "layer": 0, "kind": "inf", "pattern": "0D"},
                   {"step": 4, "site": "module:transformer.h.1.mlp", "layer": 1, "kind": "nan",
                    "pattern": "1R"}],
        "reference": _arm(faults_injected=0),
        "unprotected": _arm(non_trainable=True, steps_done=4, final_loss=math.nan),
        "checkpoint_restore": _arm(saves=3, save_s=0.3, load_s=0.1, rollbacks=1,
                                   replayed_steps=2, recovery_cost_steps=2.5, final_loss=2.1),
        "protected": _arm(faults_detected=2, faults_corrected=2, final_loss=2.05,
                          overhead=0.2, overhead_interval=[0.1, 0.3]),
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary))
    _losses("reference", [5.0, 4.0, 3.0, 2.5, 2.2, 2.0], out)
    _losses("unprotected", [5.0, 4.0, 3.0, math.nan], out)
    # a step replayed after the rollback replaces the one rolled back
    _losses("checkpoint_restore", [5.0, 4.0, 9.0, 3.0, 2.6, 2.3, 2.1], out)
    _jsonl(out / "checkpoint_restore" / "events.jsonl", [{"type": "rollback", "at_step": 3}])
    _losses("protected", [5.0, 4.0, 3.0, 2.5, 2.2, 2.05], out)
    _jsonl(out / "protected" / "events.jsonl", [
        {"type": "fault", "step": 2}, {"type": "fault", "step": 4},
        {"type": "protection", "step": 2, "module": "transformer.h.0.attn", "op": "scores",
         "pattern": "0D", "kind": "inf", "action": "corrected", "cause": "fault"},
    ])  # fmt: skip
    return out, summary


def test_each_arm_tells_what_happened_to_it(demo):
    out, _ = demo
    assert run_kind(out) == "demo" and report(out) == out / "report.html"
    html = (out / "report.html").read_text()
    assert "reference: no fault, 6 steps, final loss 2.0000." in html
    assert ("unprotected: died at step 4 (the loss became nan) after 2 fault(s); training "
            "stopped there.") in html  # fmt: skip
    assert ("checkpoint_restore: rolled back 1 time(s) (at steps 3), replayed 2 steps, final "
            "loss 2.1000.") in html  # fmt: skip
    assert ("protected: 2 of 2 detections corrected in the step, 0 step(s) skipped, no step "
            "lost, final loss 2.0500.") in html  # fmt: skip
    assert "tiny &lt;gpt2&gt;, 6 steps" in html  # the description, escaped


def test_the_table_has_one_row_per_arm_with_its_cells(demo):
    out, summary = demo
    html = demo_report(out).read_text()
    assert "".join(f"<th>{h}</th>" for h in COLUMNS) in html
    for arm in ARMS:
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in arm_row(arm, summary)) + "</tr>" in html
    assert arm_row("unprotected", summary)[5:8] == ["yes", "3.0", "stopped"]
    assert arm_row("protected", summary)[7] == "+20% [+10, +30]"
    assert arm_row("checkpoint_restore", summary)[8] == "2.5 steps, 1 rollbacks"
    assert "Overhead: none shown" in html  # no timing: the arms ran one after another


def test_the_plan_and_protections_events_are_tables(demo):
    out, _ = demo
    html = demo_report(out).read_text()
    assert "<td>module:transformer.h.1.mlp</td><td>1</td><td>nan</td><td>1R</td>" in html
    assert ("<tr><td>2</td><td>transformer.h.0.attn</td><td>scores</td><td>0D</td><td>inf</td>"
            "<td>corrected</td><td>fault</td></tr>") in html  # fmt: skip
    for name in ("loss.png", "time.png"):
        assert (out / name).read_bytes().startswith(PNG)


def test_an_arm_without_metrics_is_left_out(demo):
    out, _ = demo
    (out / "checkpoint_restore" / "metrics.jsonl").unlink()
    html = demo_report(out).read_text()
    assert "checkpoint_restore" not in html and "<td>protected</td>" in html


def test_the_diagnosis_section_shows_each_arm_step_by_step(demo):
    out, _ = demo
    assert "Diagnosis" not in demo_report(out).read_text()  # the diagnosis demo did not run
    root = out / "diagnosis"
    found = {"type": "diagnosis", "step": 2, "cause": "fault", "verdict": "your hardware",
             "message": "your hardware: 1 corrected computation fault(s) on rank 0"}  # fmt: skip
    _jsonl(root / "failing device" / "events.jsonl", [found])
    _jsonl(root / "failing device" / "metrics.jsonl", [{"step": 1, "loss": 3.0}])
    _jsonl(root / "unstable" / "events.jsonl", [])
    _jsonl(
        root / "unstable" / "metrics.jsonl", [{"step": 1, "loss": 3.5}, {"step": 2, "loss": 9.0}]
    )
    html = demo_report(out).read_text()
    assert "<h2>Diagnosis: your hardware, or not</h2>" in html
    assert ("<tr><td>2</td><td>skipped</td><td>your hardware: fault</td><td>9.000</td>"
            "<td>healthy</td></tr>") in html  # fmt: skip
    assert "<li>failing device: your hardware: 1 corrected" in html


def test_a_training_runs_page_has_its_summary_and_event_counts(tmp_path):
    _jsonl(tmp_path / "metrics.jsonl", [{"step": s, "loss": 4.0 / s} for s in (1, 2, 3)])
    _jsonl(tmp_path / "events.jsonl", [{"type": "fault", "step": 2}, {"type": "fault", "step": 3},
                                       {"type": "protection", "step": 2}, {"step": 3}])  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps({"steps_done": 3, "note": "a<b"}))
    assert [r["loss"] for r in read_metrics(tmp_path)] == [4.0, 2.0, 4.0 / 3]
    page = run_report(tmp_path)
    assert page == tmp_path / "report.html" and report(tmp_path) == page
    html = page.read_text()
    assert "<td>steps_done</td><td>3</td>" in html and "<td>note</td><td>a&lt;b</td>" in html
    assert "events: {&quot;fault&quot;: 2, &quot;protection&quot;: 1, &quot;?&quot;: 1}" in html
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG)
