"""Every fault kind at every kind of position is located and corrected; what cannot be corrected
is flagged and left as delivered, never mis-corrected."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from attnchecker.abft import Pattern, ValueKind, correct_, encode, protected_matmul, unit_roundoff
from attnchecker.inject import exponent_flip

from .helpers import DTYPES, operands

BATCH, M, K, N = (2, 3), 37, 64, 29


def _kind_fn(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def random_large(x: Tensor) -> Tensor:
        # a finite value 10^2 .. 10^(max exponent - 1) times larger than the data, random sign
        top = math.log10(torch.finfo(x.dtype).max) - 1
        mag = 10 ** (2 + (top - 2) * torch.rand(x.shape, generator=g, dtype=torch.float64))
        sign = torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
        return (x.double() + sign * mag).to(x.dtype)

    return {
        "inf": lambda x: torch.full_like(x, float("inf")),
        "-inf": lambda x: torch.full_like(x, float("-inf")),
        "nan": lambda x: torch.full_like(x, float("nan")),
        "1e10": lambda x: torch.full_like(x, 1e10, dtype=torch.float32).to(x.dtype),  # fp16: inf
        "exp_flip": exponent_flip,
        "random_large": random_large,
    }[kind]


KINDS = ("inf", "-inf", "nan", "1e10", "exp_flip", "random_large")
POSITIONS = {
    "first,first": (0, 0),
    "last,last": (M - 1, N - 1),
    "first,last": (0, N - 1),
    "last,first": (M - 1, 0),
    "middle": (M // 2, N // 3),
}
MATRICES = {"first": (0, 0), "last": (1, 2)}


def _setup(dtype: torch.dtype, seed: int = 0):
    a, b = operands(BATCH, M, K, N, dtype=dtype, scale=10.0, data="normal", seed=seed)
    return a, b, a @ b


def _assert_close_to_clean(
    c: Tensor, clean: Tensor, a: Tensor, b: Tensor, check: str = "both"
) -> None:
    """Corrected C equals the clean C within the stated tolerance: each element within the
    plain-checksum tolerance of the vector it was reconstructed from (its row, or its column
    when only columns are checked) plus one rounding to C's dtype."""
    sums = encode(a, b)
    tol = sums.col_tol[..., 0:1, :] if check == "cols" else sums.row_tol[..., 0, :, None]
    err = (c.double() - clean.double()).abs()
    bound = tol.double() + unit_roundoff(c.dtype) * clean.double().abs()
    assert torch.isfinite(c).all()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("pos", POSITIONS)
@pytest.mark.parametrize("mat", MATRICES)
def test_single_element_is_corrected(dtype, kind, pos, mat):
    a, b, clean = _setup(dtype)
    at = (*MATRICES[mat], *POSITIONS[pos])

    def fault(c: Tensor) -> None:
        c[at] = _kind_fn(kind)(c[at].clone())

    c, rep = protected_matmul(a, b, corrupt=fault)
    assert rep.detected.sum() == 1 and rep.corrected.sum() == 1
    assert rep.pattern[at[:2]] == Pattern.D0
    assert (rep.row[at[:2]], rep.col[at[:2]]) == at[2:]
    _assert_close_to_clean(c, clean, a, b)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("inf", ValueKind.POS_INF),
        ("-inf", ValueKind.NEG_INF),
        ("nan", ValueKind.NAN),
        ("1e10", ValueKind.NEAR_INF),
    ],
)
def test_value_kind_is_reported(kind, expected):
    a, b, _ = _setup(torch.float32)
    _, rep = protected_matmul(
        a, b, corrupt=lambda c: c[1, 1, 4, 5].fill_(_kind_fn(kind)(c[1, 1, 4, 5]))
    )
    assert rep.kind[1, 1] == expected
    assert rep.kind[0, 0] == ValueKind.NONE


@pytest.mark.parametrize("check", ["rows", "cols"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_direction_corrects_single_elements(check, kind):
    a, b, clean = _setup(torch.float32)

    def fault(c: Tensor) -> None:
        c[1, 0, 5, 7] = _kind_fn(kind)(c[1, 0, 5, 7].clone())

    c, rep = protected_matmul(a, b, check=check, corrupt=fault)
    assert rep.corrected[1, 0] and rep.detected.sum() == 1
    assert (rep.row[1, 0], rep.col[1, 0]) == (5, 7)
    _assert_close_to_clean(c, clean, a, b, check)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("line", "pattern"), [("row", Pattern.R1), ("col", Pattern.C1)])
def test_whole_row_and_column_are_corrected(dtype, kind, line, pattern):
    a, b, clean = _setup(dtype)
    at = (1, 2, M - 1, slice(None)) if line == "row" else (0, 1, slice(None), 0)

    def fault(c: Tensor) -> None:
        c[at] = _kind_fn(kind)(c[at].clone())

    c, rep = protected_matmul(a, b, corrupt=fault)
    assert rep.pattern[at[:2]] == pattern
    assert rep.corrected[at[:2]] and rep.detected.sum() == 1
    _assert_close_to_clean(c, clean, a, b)


def test_two_errors_in_one_row():
    """Both directions: the columns locate them (a partial 1R), corrected. One direction, or no
    operands to rebuild from: flagged uncorrectable and left exactly as delivered."""
    a, b, clean = _setup(torch.float32)

    def fault(c: Tensor) -> None:
        c[0, 1, 3, 4] = float("inf")
        c[0, 1, 3, 20] = 1e10

    c, rep = protected_matmul(a, b, corrupt=fault)
    assert rep.pattern[0, 1] == Pattern.R1 and rep.corrected[0, 1]
    _assert_close_to_clean(c, clean, a, b)

    for check in ("rows", "cols"):
        c, rep = protected_matmul(a, b, check=check, corrupt=fault)
        assert rep.detected[0, 1] and not rep.corrected[0, 1]
        delivered = clean.clone()
        fault(delivered)
        assert torch.equal(c, delivered)

    delivered = clean.clone()
    fault(delivered)
    rep = correct_(delivered, encode(a, b))  # no operands: nothing to rebuild the row from
    assert rep.pattern[0, 1] == Pattern.R1 and rep.uncorrectable[0, 1]
    assert delivered[0, 1, 3, 4] == float("inf")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "block", [(slice(2, 4), slice(5, 7)), (slice(0, 3), slice(N - 5, N)), ([1, 30], [2, 17])]
)
@pytest.mark.parametrize("kind", ["inf", "nan", "1e10", "exp_flip"])
def test_2d_errors_are_flagged_not_miscorrected(dtype, block, kind):
    a, b, clean = _setup(dtype)
    at = (1, 1, *block)

    def fault(c: Tensor) -> None:
        c[at] = _kind_fn(kind)(c[at].clone())

    delivered = clean.clone()
    fault(delivered)
    c, rep = protected_matmul(a, b, corrupt=fault)
    assert rep.pattern[1, 1] == Pattern.D2
    assert rep.uncorrectable[1, 1] and rep.uncorrectable.sum() == 1
    assert torch.equal(c.isnan(), delivered.isnan())
    assert torch.equal(c.nan_to_num(), delivered.nan_to_num())


def test_bad_operands_are_reported_not_corrected():
    a, b, _ = _setup(torch.float32)
    a = a.clone()
    a[0, 0, 3, 3] = float("inf")
    _, rep = protected_matmul(a, b)
    assert rep.pattern[0, 0] == Pattern.OPERAND and rep.uncorrectable[0, 0]
    assert not rep.detected[1, 2]


@pytest.mark.parametrize("check", ["both", "rows", "cols"])
def test_small_error_of_1e_3_of_the_row_magnitude_is_detected_fp32(check):
    """A finite error of 1e-3 of the row's L1 magnitude is detected; with both directions it is
    also corrected."""
    a, b, clean = _setup(torch.float32)
    i, j = 11, 13
    delta = 1e-3 * clean[1, 1, i].abs().sum()

    def fault(c: Tensor) -> None:
        c[1, 1, i, j] += delta

    c, rep = protected_matmul(a, b, check=check, corrupt=fault)
    assert rep.detected[1, 1]
    if check == "both":
        assert rep.corrected[1, 1]
        _assert_close_to_clean(c, clean, a, b)


@given(
    n_errors=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    check=st.sampled_from(["both", "rows", "cols"]),
    same_line=st.sampled_from([None, "row", "col"]),
    seed=st.integers(0, 2**31),
)
def test_never_silently_miscorrected(n_errors, dtype, check, same_line, seed):
    """Random faults of random kinds: each matrix ends either corrected (close to clean) or
    flagged and exactly as delivered; errors that go unflagged are below the tolerance."""
    a, b, clean = _setup(dtype, seed=seed % 7)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, M, (n_errors,), generator=g)
    cols = torch.randint(0, N, (n_errors,), generator=g)
    if same_line == "row":
        rows[:] = rows[0]
    elif same_line == "col":
        cols[:] = cols[0]
    kinds = [
        (*KINDS, "small")[int(x)]
        for x in torch.randint(0, len(KINDS) + 1, (n_errors,), generator=g)
    ]
    small = torch.randn(n_errors, generator=g).tolist()  # around the detection threshold

    def fault(c: Tensor) -> None:
        for r, q, kind, s in zip(rows.tolist(), cols.tolist(), kinds, small, strict=True):
            if kind in KINDS:
                c[0, 1, r, q] = _kind_fn(kind, seed)(c[0, 1, r, q].clone())
            else:
                c[0, 1, r, q] += s * 1e-4 * float(clean[0, 1, r].abs().sum())

    delivered = clean.clone()
    fault(delivered)
    c, rep = protected_matmul(a, b, check=check, corrupt=fault)
    ok, flagged = bool(rep.corrected[0, 1]), bool(rep.uncorrectable[0, 1])
    if ok or not rep.detected[0, 1]:
        _assert_close_to_clean(c[0, 1], clean[0, 1], a[0, 1], b[0, 1], check)
    else:
        assert flagged
        assert torch.equal(c.nan_to_num(), delivered.nan_to_num())
    assert rep.detected.sum() <= 1  # the other matrices are clean


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("check", ["both", "rows", "cols"])
def test_checksum_reconstruction_without_operands(dtype, kind, check):
    """EEC proper: no operands at hand, the element is rebuilt from its checksum and the others."""
    a, b, clean = _setup(dtype)
    sums = encode(a, b, check=check)
    c = clean.clone()
    c[1, 2, 30, 11] = _kind_fn(kind)(c[1, 2, 30, 11].clone())
    rep = correct_(c, sums)
    assert rep.corrected[1, 2] and rep.detected.sum() == 1
    assert (rep.row[1, 2], rep.col[1, 2]) == (30, 11)
    _assert_close_to_clean(c, clean, a, b, check)
