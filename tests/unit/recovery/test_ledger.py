"""recovery.ledger's rule on hand-made events: repeats within the window name a device,
numerics never do, and every device keeps its own record."""

from __future__ import annotations

import json

from attnchecker.models import Event
from attnchecker.recovery.diagnosis import Here
from attnchecker.recovery.ledger import DeviceLedger, DeviceRecord

GPU1 = Here(3, "node7", "cuda:1")
GPU0 = Here(2, "node7", "cuda:0")


def _event(step: int, *, op: str = "scores", cause: str = "fault", value=0.5) -> Event:
    return Event(step, "model.layers.1.self_attn", 1, op, "0D", "finite", "corrected", 1, 1,
                 cause=cause, value=value)  # fmt: skip


def test_faults_at_two_steps_within_the_window_name_the_device():
    ledger = DeviceLedger(window=100)
    assert ledger.observe([_event(5), _event(5, op="context")], GPU1) is None  # one step
    assert ledger.observe([_event(200, op="dq")], GPU1) is None  # 195 steps later: outside
    named = ledger.observe([_event(260)], GPU1)
    assert named is not None and named.index == 1 and named.named_at == 260
    assert named.reason == "computation faults at 2 distinct steps within 100 steps"
    assert ledger.observe([_event(261)], GPU1) is None  # named once
    ev = named.evidence()
    assert ev["steps"] == [5, 200, 260, 261] and set(ev["sites"]) == {
        "layer 1 scores", "layer 1 context", "layer 1 dq"
    }  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES=1" in ev["reproduce"] and "|y| <= 0.5" in ev["sites"]["layer 1 dq"]
    back = DeviceRecord.from_dict(json.loads(json.dumps(named.to_dict())))
    assert back == named


def test_numerics_never_count_and_devices_are_kept_apart():
    ledger = DeviceLedger()
    for step in range(1, 50):
        assert ledger.observe([_event(step, cause="numerics", value=None)], GPU1) is None
    assert ledger.observe([_event(7)], GPU0) is None  # one fault on the other device
    [one, other] = ledger.records.values()
    assert (one.numerics, one.faults, one.candidate) == (49, 0, False)
    assert (other.faults, other.numerics, other.steps) == (1, 0, [7])
    assert ledger.candidates() == []
