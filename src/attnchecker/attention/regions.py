"""Check regions: a check run as one compiled region or as its eager ops.

A check is a function of tensors (and of constants computed outside it: tolerances, sizes), so
it compiles to a few fused kernels (``torch.compile``: inductor's C++ on a CPU, Triton on CUDA)
without touching the model's own arithmetic. :func:`run` runs one as the module's
:class:`~attnchecker.attention.impl.Impl` says (:class:`~attnchecker.attention.impl.CheckImpl`:
its aten ops, or one ``torch.compile``d region per check function, compiled once per operand
shape, dtype and layout); inside a model the user compiles, the region is traced inline with
the rest, whatever the choice.

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
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from attnchecker.attention.impl import CheckImpl

__all__ = ["describe", "ran", "run"]

_VARIANTS = 64  # compiled variants per region before it falls back to its eager ops
_FAILED: dict[str, str] = {}  # region name -> why it runs eager
_RAN: dict[str, set[str]] = {}  # region name -> the implementations that ran


def ran(name: str, how: str, result: object) -> object:
    """``result``, noted as region ``name`` having run ``how`` (for :func:`describe`; not in a
    graph being compiled: no bookkeeping there)."""
    if not torch.compiler.is_compiling():
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


def run(fn: Callable[..., object], how: CheckImpl, *args: object, **kwargs: object) -> object:
    """``fn(*args, **kwargs)`` without autograd, as ``how`` says: compiled, unless compiling
    already (then inline in the caller's graph) or the region failed to compile before."""
    with torch.no_grad():
        if torch.compiler.is_compiling():  # traced inline: no bookkeeping in the graph
            return fn(*args, **kwargs)
        return _run(fn, how is CheckImpl.EAGER, *args, **kwargs)


def _run(fn: Callable[..., object], eager: bool, *args: object, **kwargs: object) -> object:
    name = fn.__qualname__
    mode = _get_current_dispatch_mode()
    if mode is not None:  # dynamo does not run under a dispatch mode (an op counter, a
        # profiler's): the same ops, uncompiled, tagged as the region's where the mode asks
        # (attnchecker.testing.OpCounter.region)
        tag = getattr(mode, "region", None)
        how = "eager" if eager or name in _FAILED else "compiled"
        with tag(name, how) if callable(tag) else contextlib.nullcontext():
            return fn(*args, **kwargs)
    if eager or name in _FAILED:
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
    inline with the model, whatever the choice."""
    return {
        name: "eager (compile failed: " + _FAILED[name] + ")" if name in _FAILED
        else ", ".join(sorted(how))
        for name, how in _RAN.items()
    }  # fmt: skip
