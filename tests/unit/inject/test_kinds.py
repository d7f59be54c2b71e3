from __future__ import annotations

import pytest
import torch

from attnchecker.inject import exponent_flip, exponent_flip_bit, flip_bit


@pytest.mark.parametrize(
    ("dtype", "width"), [(torch.float32, 32), (torch.bfloat16, 16), (torch.float16, 16)]
)
def test_flip_bit_changes_exactly_that_bit(dtype, width):
    x = torch.randn(64, dtype=dtype)
    idt = {32: torch.int32, 16: torch.int16}[width]
    for bit in (0, width // 2, width - 2, width - 1):
        y = flip_bit(x, bit)
        diff = torch.bitwise_xor(x.view(idt), y.view(idt))
        assert (diff == torch.tensor(1, dtype=idt) << bit).all()
        assert torch.equal(flip_bit(y, bit).view(idt), x.view(idt))  # an involution


def test_reference_rule_fp32():
    x = torch.tensor([0.5, -0.25, 1.5, 3.0, -100.0])
    assert exponent_flip_bit(x).tolist() == [30, 30, 30, 29, 29]
    y = exponent_flip(x)
    assert y[0] == 0.5 * 2.0**128 and y[1] == -0.25 * 2.0**128  # |x| < 1: near-INF
    assert not torch.isfinite(y[2])  # 1 <= |x| < 2: INF or NaN
    assert y[3] == 3.0 * 2.0**64 and y[4] == -100.0 * 2.0**64  # |x| >= 2: times 2^64


def test_reference_rule_half_precisions():
    x = torch.tensor([0.5, 3.0])
    assert exponent_flip(x.to(torch.bfloat16)).float().tolist() == [0.5 * 2.0**128, 3.0 * 2.0**64]
    assert exponent_flip(x.to(torch.float16)).float().tolist() == [0.5 * 2.0**16, 3.0 * 2.0**8]


def test_rejects_other_dtypes_and_bits():
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        flip_bit(torch.zeros(2, dtype=torch.float64), 3)
    with pytest.raises(ValueError, match="bit must be in"):
        flip_bit(torch.zeros(2), 32)
