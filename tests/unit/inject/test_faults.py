"""Fault kinds are defined once (attnchecker.faults): every kind has an edit, and the fused
kernels' edit of a kind is the eager sites' edit, element for element (fp32, the kernels' tiles)."""

from __future__ import annotations

import pytest
import torch

from attnchecker import faults
from attnchecker.faults import KERNEL_MODES, KINDS, MODES, FaultKind, edit, kernel_edit

try:
    import triton
    import triton.language as tl

    from attnchecker.kernels.common import corrupt
except ImportError:  # no triton on this platform: the kernel test is skipped
    triton = None
else:

    @triton.jit
    def _apply(X, Y, N: tl.constexpr, val, mode, bit):
        """Y = X with the fault (val, mode, bit) applied to every element."""
        offs = tl.arange(0, N)
        tl.store(Y + offs, corrupt(tl.load(X + offs), offs >= 0, val, mode, bit))


X = torch.tensor([0.5, -0.25, 1.5, 3.0, -100.0, 0.0, 7.0, 1e-3])


def test_every_kind_has_one_edit_with_a_known_mode():
    assert set(KINDS) == set(FaultKind)
    assert {k.mode for k in KINDS.values()} <= set(MODES)
    assert set(KERNEL_MODES) == {k for k, spec in KINDS.items() if spec.kernel}


def test_inject_and_kernels_read_the_one_table():
    from attnchecker.inject import kinds

    assert kinds.FaultKind is FaultKind and kinds.KERNEL_MODES is KERNEL_MODES
    assert kinds.apply_kind is faults.apply_kind
    common = pytest.importorskip("attnchecker.kernels.common")
    assert common.MODES is MODES


def test_kernel_edit_refuses_a_kind_the_kernels_do_not_express(monkeypatch):
    from attnchecker.errors import ConfigError

    table = dict(KINDS)
    table[FaultKind.RANDOM] = faults.Kind("set", 1e8, drawn=True, kernel=False)
    monkeypatch.setattr(faults, "KINDS", table)
    with pytest.raises(ConfigError, match="cannot express fault kind random"):
        kernel_edit("random", value=None, generator=None)


# the kernel computes every mode's result and selects one: INF x 0 in the unselected ones
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("kind", list(KERNEL_MODES))
@pytest.mark.parametrize("value", [None, 3.7])
def test_the_kernels_edit_is_the_eager_edit(kind, value):
    """``kernels.common.corrupt`` with the (mode, value) of
    ``kernel_edit`` gives what ``edit`` gives the eager sites; RANDOM draws one value per fault
    in the kernels, so there every element takes the kernel's draw."""
    if triton is None:
        pytest.skip("needs triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter
    x = X.to(device)
    mode, v = kernel_edit(kind, value=value, generator=torch.Generator().manual_seed(0))
    got = torch.empty_like(x)
    _apply[(1,)](x, got, x.numel(), v, MODES[mode], 5)
    want = torch.full_like(x, v) if KINDS[kind].drawn else edit(kind, x, bit=5, value=value)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
