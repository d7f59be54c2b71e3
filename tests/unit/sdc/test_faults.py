"""sdc.faults.SDCModel (validation, the on/off schedule, what ``corrupt_`` does to a tensor) and
the lockstep's element comparison (``mismatch``) and output rule (``output_tensor``), on small
hand-made tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnchecker.errors import ConfigError
from attnchecker.sdc import STUDY_NODE, LockstepConfig, SDCModel
from attnchecker.sdc.lockstep import mismatch, output_tensor


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


BAD = [{"rate": 1.5}, {"mlp_rate": -0.1}, {"tail": 2.0}, {"bitflip": -1.0}, {"nonfinite": 1.01},
       {"log_rel_min": -1.0, "log_rel_max": -2.0}]  # fmt: skip


@pytest.mark.parametrize("bad", BAD)
def test_bad_settings_are_config_errors(bad):
    with pytest.raises(ConfigError):
        SDCModel(**bad)


def test_the_study_preset_is_in_the_studys_range_and_never_crashes_a_run():
    assert 1e-7 <= STUDY_NODE.mlp_rate < STUDY_NODE.rate <= 3e-2
    assert STUDY_NODE.nonfinite == 0.0 and STUDY_NODE.forward and STUDY_NODE.backward


def test_a_lockstep_level_outside_1_to_3_is_refused():
    with pytest.raises(ConfigError, match="level must be 1, 2 or 3"):
        LockstepConfig(level=4)


@given(onset=st.integers(1, 20), burst=st.integers(0, 5), gap=st.integers(0, 5))
def test_faults_come_in_bursts_after_the_onset(onset, burst, gap):
    m = SDCModel(onset=onset, burst=burst, gap=gap)
    on = [m.active(s) for s in range(1, onset + 40)]
    assert not any(on[: onset - 1])  # never before the onset
    after = on[onset - 1 :]
    if burst == 0:
        assert all(after)
        return
    period = burst + gap
    assert after[:burst] == [True] * burst  # a burst starts at the onset
    for start in range(len(after) - period + 1):  # every window of one period: one burst
        assert sum(after[start : start + period]) == burst


def test_no_rate_no_corruption():
    t = torch.randn(100, generator=_gen())
    before = t.clone()
    assert SDCModel().corrupt_(t, site_rate=0.0, generator=_gen()) == 0
    assert SDCModel().corrupt_(torch.empty(0), site_rate=0.5, generator=_gen()) == 0
    assert torch.equal(t, before)


@given(
    seed=st.integers(0, 1000),
    rate=st.floats(0.01, 0.5),
    lo=st.floats(-4.0, -1.0),
    width=st.floats(0.0, 2.0),
)
def test_small_errors_are_within_the_configured_relative_range(seed, rate, lo, width):
    m = SDCModel(log_rel_min=lo, log_rel_max=lo + width, tail=0.0)
    old = torch.randn(400, generator=_gen(seed)) + 3.0 * torch.sign(torch.randn(400))
    t = old.clone()
    hits = m.corrupt_(t, site_rate=rate, generator=_gen(seed))
    again = old.clone()
    assert m.corrupt_(again, site_rate=rate, generator=_gen(seed)) == hits  # seeded
    assert torch.equal(again, t)
    changed = t != old
    assert int(changed.sum()) <= hits
    rel = ((t - old).abs() / old.abs().clamp_min(1e-6))[changed]
    assert bool((rel >= 10**lo * 0.999).all()) and bool((rel <= 10 ** (lo + width) * 1.001).all())
    assert bool(t.isfinite().all())


@given(seed=st.integers(0, 1000), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_bit_flip_changes_exactly_one_bit(seed, dtype):
    m = SDCModel(bitflip=1.0)
    old = torch.randn(256, generator=_gen(seed)).to(dtype)
    t = old.clone()
    hits = m.corrupt_(t, site_rate=0.05, generator=_gen(seed))
    view = torch.int32 if dtype == torch.float32 else torch.int16
    diff = (t.view(view) ^ old.view(view)).long() & ((1 << (8 * t.element_size())) - 1)
    assert 0 < int((diff != 0).sum()) <= hits
    # a flip into the all-ones exponent may make a NaN, whose payload the cast canonicalises
    changed = diff[(diff != 0) & ~t.isnan()]
    assert bool((changed & (changed - 1) == 0).all())  # a power of two: one bit


@given(seed=st.integers(0, 1000))
def test_nonfinite_corruption_is_nan_or_plus_inf_at_the_hit_elements(seed):
    old = torch.rand(200, generator=_gen(seed)) + 0.5
    t = old.clone()
    hits = SDCModel(nonfinite=1.0).corrupt_(t, site_rate=0.05, generator=_gen(seed))
    bad = ~t.isfinite()
    assert 0 < int(bad.sum()) <= hits and torch.equal(bad, t != old)
    assert not bool((t == -float("inf")).any())


def test_mismatch_counts_differences_nan_aware_and_within_a_tolerance():
    h = torch.tensor([1.0, 2.0, float("nan"), 0.0, -4.0])
    assert mismatch(h.clone(), h) == (0, 0.0)  # a NaN where the healthy one has NaN is equal
    f = h.clone()
    f[1], f[4] = 2.02, -4.04  # 1% each
    n, sev = mismatch(f, h)
    assert n == 2 and sev == pytest.approx(0.01, rel=1e-4)
    assert mismatch(f, h, tol=0.02) == (0, 0.0)
    assert mismatch(f, h, tol=0.005)[0] == 2
    f[3] = 1e-3  # against an exact zero: floored at 1e-6 of the largest |h|, finite
    n, sev = mismatch(f, h)
    assert n == 3 and sev == pytest.approx((0.01 + 0.01 + 1e-3 / 4e-6) / 3, rel=1e-4)
    g = h.clone()
    g[0] = float("nan")  # a new NaN is a mismatch of infinite severity
    assert mismatch(g, h) == (1, float("inf"))


@given(k=st.integers(1, 20), seed=st.integers(0, 100))
def test_mismatch_finds_each_changed_element(k, seed):
    h = torch.randn(64, generator=_gen(seed)) + 5.0
    idx = torch.randperm(64, generator=_gen(seed))[:k]
    f = h.clone()
    f[idx] *= 1.5
    n, sev = mismatch(f, h)
    assert n == k and sev == pytest.approx(0.5, rel=1e-5)


def test_output_tensor_is_the_tensor_or_the_first_of_a_tuple():
    t = torch.ones(2)
    assert output_tensor(t) is t
    assert output_tensor((t, None)) is t and output_tensor([t]) is t
    assert output_tensor(()) is None and output_tensor((None, t)) is None
    assert output_tensor({"x": t}) is None and output_tensor(None) is None
