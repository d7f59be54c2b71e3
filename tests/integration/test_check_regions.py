"""The backward's linear-layer checks as compiled regions (``check_impl="compiled"``, what the
default ``"auto"`` runs where inductor builds; the rest of the suite runs their eager ops, see
``tests/conftest.py``): the same records and repairs as the eager ops, a clean step bitwise the
eager-checked one, and a region that cannot compile falls back to its eager ops with a warning.

Each region compiles once per dtype and layout (then once more, dynamic in the sizes): a few
seconds each on this CPU, so two families (Conv1D's and nn.Linear's layouts) in fp32.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

from attnchecker import ABFTConfig, protect_
from attnchecker.abft import regions
from attnchecker.attention.config import GRAD_OPS

from .helpers import PATTERNS, batch, models, train_step
from .test_protect_backward import EXTREME, _matrix

LINEAR_GRAD_OPS = tuple(op for op in GRAD_OPS if op.startswith(("dx.", "dw.")))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_regions_check_and_repair_as_the_eager_ops(family):
    base, _ = models(family)
    inputs = batch(family)
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    h_eager = protect_(eager, ABFTConfig(check_impl="eager"))
    h_compiled = protect_(compiled, ABFTConfig(check_impl="compiled"))
    for _ in range(2):  # clean steps: no alarm, and the model's own arithmetic untouched
        want, got = train_step(eager, inputs), train_step(compiled, inputs)
        assert h_eager.drain() == [] and h_compiled.drain() == []
        assert torch.equal(got[0], want[0])
        for name, g in got[1].items():
            assert torch.equal(g, want[1][name]), name
    summary = h_compiled.summary()
    assert summary["check_impl"] == "compiled"
    # what ran in this process: the compiled region (and the eager-checked copy's eager ops)
    assert "compiled" in summary["check_regions"]["_gemm_region"].split(", ")

    # every linear backward site x every pattern, the extreme kinds taking turns: corrected in
    # the same step (loss, gradients, update equal the fault-free step), as the eager ops do
    kinds = itertools.cycle(EXTREME)
    cases = [(s, next(kinds), p) for s in LINEAR_GRAD_OPS for p in PATTERNS]
    failures, ran, _ = _matrix(family, cases, config=ABFTConfig(check_impl="compiled"))
    assert ran >= 4 * len(PATTERNS)
    assert failures == []


def _needs_a_host_value(x: torch.Tensor) -> torch.Tensor:
    """A region dynamo cannot capture as one graph (it branches on a tensor's value)."""
    return x * 2 if x.sum().item() > 0 else x


def test_a_region_that_does_not_compile_runs_its_eager_ops_with_one_warning():
    x = torch.ones(4)
    with pytest.warns(RuntimeWarning, match="did not compile"):
        got = regions.run(_needs_a_host_value, "compiled", x)
    assert torch.equal(got, x * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: later calls run eager silently
        assert torch.equal(regions.run(_needs_a_host_value, "compiled", x), x * 2)
    assert regions.describe()["_needs_a_host_value"].startswith("eager (compile failed:")


def test_auto_follows_the_environment(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("ATTNCHECKER_CHECK_IMPL", "eager")
    assert regions.resolve("auto", cpu) == "eager"
    assert regions.resolve("compiled", cpu) == "compiled"  # an explicit config wins
    monkeypatch.setenv("ATTNCHECKER_CHECK_IMPL", "bogus")
    with pytest.raises(ValueError, match="ATTNCHECKER_CHECK_IMPL"):
        regions.resolve("auto", cpu)
    monkeypatch.delenv("ATTNCHECKER_CHECK_IMPL")
    assert regions.resolve("auto", cpu) == "compiled"  # this machine has a C++ compiler
