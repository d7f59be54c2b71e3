"""The typed handoff from the projection checks to the core is used only where it fits."""

from __future__ import annotations

import torch

from attnchecker.attention.handoff import Handoff, Part


def _part(B, L, heads):
    return Part(torch.rand(B, L, heads), torch.randn(B, L, heads))


def test_matching_parts_are_used_in_the_core_layout():
    h = Handoff(q=_part(2, 5, 4), k=_part(2, 5, 2), v=_part(2, 5, 2))
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    got = h.for_core(q, k, v, norm_scale=1.5)
    qn, kn = got.qk_norms
    assert qn.shape == (2, 4, 5) and torch.equal(qn, h.q.bound.transpose(1, 2) * 1.5)
    assert kn.shape == (2, 2) and torch.allclose(kn, h.k.bound.sum(1) * 1.5)
    sums, bound = got.v_rows
    assert torch.equal(sums, h.v.sums.transpose(1, 2)) and bound.shape == (2, 2, 5)


def test_a_kv_cache_drops_the_key_and_value_parts():
    """Decoding: one new token projected, the cache holds 9; the Q part still fits."""
    h = Handoff(q=_part(2, 1, 4), k=_part(2, 1, 2), v=_part(2, 1, 2))
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    got = h.for_core(q, k, v, norm_scale=1.0)
    assert got.qk_norms is None and got.v_rows is None


def test_unknown_math_between_projection_and_core_drops_the_norm_bounds():
    h = Handoff(q=_part(1, 3, 2), k=_part(1, 3, 2), v=_part(1, 3, 2))
    q = k = v = torch.randn(1, 2, 3, 4)
    got = h.for_core(q, k, v, norm_scale=None)
    assert got.qk_norms is None and got.v_rows is not None


def test_merge_keeps_the_query_of_the_same_call():
    """Cross-attention: Q is checked on the decoder states, then K/V on the encoder states."""
    q_only = Handoff(q=_part(2, 5, 4))
    merged = q_only.merge(Handoff(k=_part(2, 7, 4), v=_part(2, 7, 4)))
    assert merged.q is q_only.q and merged.k is not None and merged.v is not None
