"""Check regions: a check run as one compiled region or as its eager ops, chosen per device.

A check is a function of tensors (and of constants computed outside it: tolerances, sizes), so
it compiles to a few fused kernels (``torch.compile``: inductor's C++ on a CPU, Triton on CUDA)
without touching the model's own arithmetic. Three implementations, :data:`IMPLS`:

- ``"eager"``: the check's aten ops (no compiler needed; tens of launches per checked GEMM);
- ``"compiled"``: one ``torch.compile``d region per check function, compiled once per operand
  shape, dtype and layout (2-7 s each on a 2-core CPU; a transformer has a few: one per distinct
  linear-layer shape and check), run from eager code; inside a model the user compiles, the
  region is traced inline with the rest;
- ``"triton"``: hand-written Triton kernels, each a registered op, where a check has them
  (the GEMM checks: a projection's forward check, :mod:`attnchecker.kernels.projection_check`;
  a linear layer's dX and dW checks and :func:`attnchecker.abft.gemm.gemm_check_`,
  :mod:`attnchecker.kernels.gemm_check`), on CUDA or in Triton's interpreter; every other
  region, and a CPU without the interpreter, as measured (:data:`AUTO`: compiled on CUDA,
  which there is inductor's Triton);
- ``"auto"``: ``"triton"`` on CUDA (issue 42: a check there is two or three launches, not
  60-90); elsewhere compiled where it measured faster (:data:`AUTO`: on a CPU for bf16 / fp16
  checks, not fp32 ones) and inductor can build for the device (a C++ compiler), else eager.

The regions: :func:`attnchecker.abft.gemm.gemm_check_` (one GEMM's check and repair),
:func:`attnchecker.attention.checks.projection_check_` (the forward's projections, and every
linear layer's with ``scope="all_linear"``), ``attnchecker.attention.core._core_region`` (the
forward core's scores, probabilities and context checks and their one repair),
``attnchecker.attention.grads._linear_grad_region`` (a checked linear layer's backward: its dX
and dW checks, the norms they share and their records), ``_matmul_grad_region`` (the core's
dQ, dK, dP, dV as :func:`attnchecker.attention.grads.heads_grad_check_`, and their records) and
``attnchecker.attention.records._records_region`` (a layer's forward records into log rows). A
region called inside another is traced inline with it (one compiled program). What stays
outside them is the model's own GEMMs, one ``index_add_`` of records per layer, the stacking of
Q|K|V's weights and autocast's casts (``attnchecker.testing.OpCounter`` counts them apart,
``attnchecker.testing.region_kernels`` the regions' kernels).

A region that fails to compile (no compiler at run time, an inductor error) falls back to its
eager ops with one warning naming the cause; :func:`describe` says what ran, for ``summary()``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["IMPLS", "describe", "ran", "resolve", "run"]

IMPLS = ("auto", "compiled", "eager", "triton")

_VARIANTS = 64  # compiled variants per region before it falls back to its eager ops
_FAILED: dict[str, str] = {}  # region name -> why it runs eager
_RAN: dict[str, set[str]] = {}  # region name -> the implementations that ran


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


def resolve(impl: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``"triton"``, ``"compiled"`` or ``"eager"``: what ``impl`` means for a check on
    ``device`` whose GEMM output is ``dtype``; ``"auto"`` defers to ``$ATTNCHECKER_CHECK_IMPL``
    when it is set (e.g. ``eager`` where compiling is not worth its seconds: short jobs, test
    suites), else is ``"triton"`` on CUDA (the GEMM checks' registered ops, a few launches a
    check; every other region compiled) and elsewhere picks by measurement (:data:`AUTO`)."""
    if impl == "auto":
        impl = os.environ.get("ATTNCHECKER_CHECK_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"ATTNCHECKER_CHECK_IMPL must be one of {list(IMPLS)}, got {impl!r}")
    if impl == "auto" and device.type == "cuda" and _can_compile("cuda"):
        return "triton"
    return _measured(device, dtype) if impl == "auto" else impl


def _measured(device: torch.device, dtype: torch.dtype | None) -> str:
    """``"compiled"`` where :data:`AUTO` says compiling wins and inductor builds, else
    ``"eager"``."""
    half = dtype in (torch.bfloat16, torch.float16)
    wins = AUTO.get((device.type, "half" if half else "fp32"), False)
    return "compiled" if wins and _can_compile(device.type) else "eager"


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


def ran(name: str, how: str, result: object) -> object:
    """``result``, noted as region ``name`` having run ``how`` (for :func:`describe`)."""
    _RAN.setdefault(name, set()).add(how)
    return result


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    # static sizes: a region's tolerances are Python floats of the sizes (a float argument is
    # a guarded constant), so a new size is a new variant either way; a model has a few.
    # emulate_precision_casts: fused bf16 / fp16 ops round after each op as eager does, so a
    # region's recomputation reproduces the delivered values bit for bit where eager would
    # (found 2026-12-03: without it an fp16 overflow recomputed in fused fp32 came out finite,
    # and `make demo`'s unstable-numerics run was diagnosed as a hardware fault)
    return torch.compile(
        fn, fullgraph=True, dynamic=False, options={"emulate_precision_casts": True}
    )


def run(
    fn: Callable[..., object], impl: str, *args: object, on: torch.Tensor, **kwargs: object
) -> object:
    """``fn(*args, **kwargs)`` without autograd, as ``impl`` runs it (:func:`resolve`d for the
    checked tensor ``on``, its device and dtype): compiled, unless compiling already (then
    inline in the caller's graph) or the region failed to compile before."""
    with torch.no_grad():
        if torch.compiler.is_compiling():  # traced inline: no bookkeeping in the graph
            return fn(*args, **kwargs)
        how = resolve(impl, on.device, on.dtype)
        if how == "triton":  # a region without Triton kernels of its own: as measured
            how = _measured(on.device, on.dtype)
        return _run(fn, how, *args, **kwargs)


def _run(fn: Callable[..., object], impl: str, *args: object, **kwargs: object) -> object:
    name = fn.__qualname__
    mode = _get_current_dispatch_mode()
    if mode is not None:  # dynamo does not run under a dispatch mode (an op counter, a
        # profiler's): the same ops, uncompiled, tagged as the region's where the mode asks
        # (attnchecker.testing.OpCounter.region)
        tag = getattr(mode, "region", None)
        how = "eager" if impl == "eager" or name in _FAILED else "compiled"
        with tag(name, how) if callable(tag) else contextlib.nullcontext():
            return fn(*args, **kwargs)
    if impl == "eager" or name in _FAILED:
        _RAN.setdefault(name, set()).add("eager")
        return fn(*args, **kwargs)
    try:
        # each dtype, layout and dynamic variant of a region is a cache entry of its code
        # object: a model with many layer shapes needs more than dynamo's default 8
        with torch._dynamo.config.patch(recompile_limit=_VARIANTS):
            out = _compiled(fn)(*args, **kwargs)
    except Exception as e:  # compilation failed: the region's eager ops give the same result
        _FAILED[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(
            f"attnchecker: the check region {name} did not compile ({_FAILED[name]}); "
            "it runs as eager ops",
            RuntimeWarning,
            stacklevel=3,
        )
        return fn(*args, **kwargs)
    _RAN.setdefault(name, set()).add("compiled")
    return out


def describe() -> dict[str, str]:
    """Per check region that ran from eager code in this process: how (``compiled``,
    ``eager``, or ``eager (compile failed: ...)``); inside a compiled model a region is traced
    inline with the model, whatever ``impl`` says."""
    return {
        name: "eager (compile failed: " + _FAILED[name] + ")" if name in _FAILED
        else ", ".join(sorted(how))
        for name, how in _RAN.items()
    }  # fmt: skip
