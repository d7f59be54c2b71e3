"""The typed handoff from the V projection check to the core is used only where it fits."""

from __future__ import annotations

import torch

from attnchecker.attention.handoff import Handoff


def _handoff(B: int, L: int, heads: int) -> Handoff:
    return Handoff(torch.randn(B, L, heads), torch.rand(B, L, heads))


def test_matching_sums_are_used_in_the_core_layout():
    h = _handoff(2, 5, 3)  # (B, L, heads)
    got = h.for_core(torch.randn(2, 3, 5, 8))  # (B, heads, L, d)
    assert got is not None
    assert torch.equal(got[0], h.v_sums.transpose(1, 2))
    assert torch.equal(got[1], h.v_err.transpose(1, 2))


def test_a_kv_cache_or_another_call_drops_them():
    """Decoding: one new token projected, the cache holds 9; a different batch or head count."""
    h = _handoff(2, 1, 3)
    assert h.for_core(torch.randn(2, 3, 9, 8)) is None
    assert h.for_core(torch.randn(1, 3, 1, 8)) is None
    assert h.for_core(torch.randn(2, 6, 1, 8)) is None
    assert h.for_core(torch.randn(2, 3, 1, 8)) is not None
