"""The public surface: light imports, the CLI, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attnchecker
from attnchecker import cli
from attnchecker.abft import protected_matmul


def test_import_loads_no_transformers_no_matplotlib():
    code = (
        "import sys, attnchecker, attnchecker.abft, attnchecker.inject;"
        "bad = [m for m in ('transformers', 'matplotlib') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_exist():
    for name in attnchecker.__all__:
        assert hasattr(attnchecker, name), name


def test_bad_operands_raise_clear_errors():
    with pytest.raises(ValueError, match="inner dimensions differ"):
        protected_matmul(torch.zeros(3, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="at least 2-D"):
        protected_matmul(torch.zeros(4), torch.zeros(4, 2))
    with pytest.raises(ValueError, match="check must be one of"):
        protected_matmul(torch.zeros(3, 4), torch.zeros(4, 2), check="diagonal")


def test_demo_corrects_every_correctable_scenario(capsys):
    from attnchecker.demo import run_math_demo

    records = run_math_demo(seed=3)
    by_name = {r["scenario"]: r for r in records}
    assert by_name["2D block of 1e10"]["status"] == "flagged"
    corrected = [r for r in records[:-2] if r["status"] == "corrected"]
    assert len(corrected) == len(records) - 2
    for r in corrected:
        assert abs(r["corrected"] - r["fault_free"]) < 1e-3
    assert records[-1]["max_grad_diff"] < 1e-5
    assert "corrected" in capsys.readouterr().out


def test_cli_demo_exit_code(tmp_path):
    assert cli.main(["demo", "--seed", "1", "--steps", "0", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize(
    "backend",
    ["eager", pytest.param("triton", marks=pytest.mark.slow)],  # interpreter: ~1 min
)
def test_model_demo_shows_unprotected_failing_and_protected_exact(backend):
    from attnchecker.demo import run_model_demo
    from attnchecker.kernels import available

    if backend == "triton" and not available():
        pytest.skip("needs triton (CUDA or the interpreter)")
    records = run_model_demo(family="llama", backend=backend)
    assert len(records) == (5 if backend == "eager" else 6)
    for r in records:
        # the unprotected step moved the weights (NaN counts) or has a NaN loss
        assert (
            not r["unprotected_param_diff"] <= 1e-3
            or r["unprotected_loss"] != r["unprotected_loss"]
        )
        assert r["protected_grad_diff"] < 1e-5
        assert r["protected_events"] and all(
            "uncorrectable" not in e for e in r["protected_events"]
        )


def test_every_exception_class_is_defined_in_errors():
    """One home for the public errors: no module of the package but ``attnchecker.errors``
    defines an exception class (``kernels`` needs triton, so it is skipped where it is absent)."""
    import importlib
    import inspect
    import pkgutil

    strays = []
    for info in pkgutil.walk_packages(attnchecker.__path__, "attnchecker."):
        if info.name.endswith("__main__"):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (triton) absent here
            continue
        for name, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
                and info.name != "attnchecker.errors"
            ):
                strays.append(f"{info.name}.{name}")  # fmt: skip
    assert strays == []
