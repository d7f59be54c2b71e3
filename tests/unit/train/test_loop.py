"""The training loop's counting: detections are summed over ``Event.count``, not events."""

from __future__ import annotations

from attnchecker.models.handle import Event
from attnchecker.train.loop import tally_events


def _event(action: str, count: int, op: str = "scores") -> Event:
    return Event(3, "transformer.h.0.attn", 0, op, "0D", "inf", action, 1, 1, count=count)


def test_tally_sums_the_detections_of_each_event():
    """Several detections of one op between two drains are one event with ``count`` n."""
    events = [_event("corrected", 3), _event("recomputed", 2, "probs"), _event("uncorrectable", 4)]
    assert tally_events(events) == {"detected": 9, "corrected": 5, "uncorrectable": 4}


def test_tally_of_no_event():
    assert tally_events([]) == {"detected": 0, "corrected": 0, "uncorrectable": 0}
