"""How a protected module's checks run, chosen once and held as a value.

``ABFTConfig.check_impl`` names a wish (``"auto"``, ``"compiled"``, ``"eager"``, ``"triton"``,
``"accumulator"``);
:func:`resolve` turns it, for the device the module is on, into an :class:`Impl`: whether the
GEMM checks and the SDPA route's check ops run their registered Triton ops (``kernels``), and
how every other check region runs (:class:`CheckImpl`, per output precision). It runs at
``protect_`` and again when a module's records follow it to another device
(:meth:`~attnchecker.attention.state.AttentionState.follow`); everything downstream reads the
value. The environment is read here and nowhere else (:data:`ENV`).

The choices:

- ``"eager"``: every check as its aten ops (no compiler needed; tens of launches per GEMM);
- ``"compiled"``: each check region one ``torch.compile``d program (2-7 s to compile each on a
  2-core CPU; :mod:`~attnchecker.attention.regions`);
- ``"triton"``: the GEMM checks (a projection's forward check, a linear layer's dX and dW) and
  the SDPA route's checks as registered Triton ops (two or three launches a check), on CUDA or
  in Triton's interpreter; every other region as measured (:data:`AUTO`);
- ``"accumulator"`` (opt-in): as ``"triton"``, and the checked linear layers' GEMMs (with
  ``scope="all_linear"`` their forward y; every checked dX and dW) computed by the accumulator
  GEMM (:mod:`attnchecker.kernels.acc_gemm`), which checks each row on its fp32 accumulator
  (~1e-4 of the row, against ~0.01 for a check of bf16 outputs) instead of cuBLAS's product
  checked after it; where the kernels cannot run (a CPU without Triton's interpreter) the
  same as ``"triton"`` there (``protect_`` warns);
- ``"auto"``: :data:`ENV` when it is set, else ``"triton"`` on CUDA where triton imports, and
  elsewhere compiled where it measured faster (:data:`AUTO`) and inductor builds, else eager.
"""

from __future__ import annotations

import enum
import functools
import os
import shutil
from dataclasses import dataclass

import torch

from attnchecker.errors import ConfigError

__all__ = ["AUTO", "ENV", "IMPLS", "CheckImpl", "Impl", "resolve"]

ENV = "ATTNCHECKER_CHECK_IMPL"
"""The environment variable that ``check_impl="auto"`` defers to (``eager`` where compiling is
not worth its seconds: short jobs, test suites)."""

IMPLS = ("auto", "compiled", "eager", "triton", "accumulator")
"""The names ``check_impl`` and :data:`ENV` take."""


class CheckImpl(enum.Enum):
    """How one check region runs from eager code."""

    EAGER = "eager"
    COMPILED = "compiled"


# Where "auto" compiles, by (device type, half precision or fp32). CPU: measured per training
# step in benchmarks/check_impl.py (2 cores, base width; results/check_impl_cpu2_2026-12-02.md):
# bf16 gains 4-9 points of step overhead in each of three runs, fp32 between -3.9 and +4.0
# points (its eager ops are already fast; a region's call and guards are not free): within the
# noise, so no compile latency for it. Rerun 2026-12-03 with every check a region
# (check_impl_cpu2_2026-12-03.md): compiled wins fp32 by 3.3-3.5 points (gpt2 / llama), yet
# fp32 stays eager: the first compilation (tens of seconds) outweighs 3% of a CPU job below
# ~1,000 steps (demos, tests, short runs). CUDA: not measured yet (no GPU lent); compiled,
# because there each of a check's ~60 eager ops is a kernel launch.
AUTO = {
    ("cpu", "half"): True,
    ("cpu", "fp32"): False,
    ("cuda", "half"): True,
    ("cuda", "fp32"): True,
}


@functools.cache
def _can_compile(device_type: str) -> bool:
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    if device_type == "cpu":
        return any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    return False


@dataclass(frozen=True)
class Impl:
    """The resolved implementation of one module's checks on one device: ``name``, what
    ``check_impl`` resolved to; ``kernels``, the GEMM checks and the SDPA route's check ops run
    their registered Triton ops; ``accumulator``, the checked linear layers' GEMMs are the
    accumulator GEMM's (:mod:`attnchecker.kernels.acc_gemm`); ``half`` / ``fp32``, how every
    other check region runs for a checked tensor in half precision (bf16, fp16) or not."""

    name: str
    kernels: bool = False
    accumulator: bool = False
    half: CheckImpl = CheckImpl.EAGER
    fp32: CheckImpl = CheckImpl.EAGER

    def region(self, dtype: torch.dtype) -> CheckImpl:
        """How a check region runs whose checked tensor is ``dtype``."""
        return self.half if dtype in (torch.bfloat16, torch.float16) else self.fp32


EAGER = Impl("eager")
"""Every check as its aten ops (a check called outside a protected module: tests, benchmarks)."""


def _measured(device: torch.device) -> tuple[CheckImpl, CheckImpl]:
    """(half, fp32): compiled where :data:`AUTO` says compiling wins and inductor builds."""
    build = _can_compile(device.type)
    return tuple(
        CheckImpl.COMPILED if AUTO.get((device.type, p), False) and build else CheckImpl.EAGER
        for p in ("half", "fp32")
    )  # type: ignore[return-value]


def resolve(check_impl: str, device: torch.device) -> Impl:
    """What ``check_impl`` (``ABFTConfig.check_impl``) means for a module on ``device``."""
    name = check_impl
    if name == "auto":
        name = os.environ.get(ENV, "auto")
        if name not in IMPLS:
            raise ConfigError(f"{ENV} must be one of {list(IMPLS)}, got {name!r}")
    if name == "auto" and device.type == "cuda" and _can_compile("cuda"):
        name = "triton"
    if name in ("compiled", "eager"):
        how = CheckImpl(name)
        return Impl(name, half=how, fp32=how)
    half, fp32 = _measured(device)
    kernels = name in ("triton", "accumulator") and _kernels_run(device)
    if name == "accumulator":
        return Impl(name, kernels=kernels, accumulator=kernels, half=half, fp32=fp32)
    return Impl(name if name == "triton" else "auto", kernels=kernels, half=half, fp32=fp32)


def _kernels_run(device: torch.device) -> bool:
    """Whether the registered Triton ops can run on ``device``: triton imports, and the device
    is CUDA or the kernels run in Triton's interpreter."""
    from attnchecker import kernels

    return kernels.available() and (device.type == "cuda" or kernels.interpreting())
