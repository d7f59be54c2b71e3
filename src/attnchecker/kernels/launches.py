"""What the Triton kernels launch, seen on a machine without a GPU (``../shared/spec/gpu-path.md``
§7): every launch's grid and the bytes of its tensor arguments, and its programs run in another
order than the interpreter's.

Both work by replacing the interpreter's grid executor (``TRITON_INTERPRET=1``) while active:

- :func:`recorded` appends a :class:`Launch` per kernel launch; with ``run=False`` nothing runs
  (the outputs stay as allocated), so a step at widths this machine could not compute in
  minutes is audited in seconds (:class:`SkipCompute` skips the torch ops the same way);
  inside it, :func:`attnchecker.kernels.triton_utils.readable` hands bf16 tensors to the
  kernels as they are, as on a GPU, so the bytes are the GPU's;
- :func:`program_order` runs each launch's programs in another order (``"reversed"``,
  ``"gpu"``: x fastest, as a GPU hands out blocks, ``"random"``), so a test can compare every
  byte a kernel writes with the in-order run: a kernel whose output depends on which program
  runs first (an atomic claim, a read of another program's store) shows it here.

What neither can see: interleavings inside a program (the interpreter runs a program as whole
arrays, not warps), and how long anything takes.
"""

from __future__ import annotations

import contextlib
import inspect
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Launch", "SkipCompute", "arg_bytes", "as_on_gpu", "current", "host_flag",
           "program_order", "recorded"]  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its grid and the bytes of its distinct tensor arguments (an upper
    bound of what its programs touch: a repair that returns on a clean flag reads little of
    them)."""

    kernel: str
    grid: tuple[int, int, int]
    bytes: int

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def per_program(self) -> float:
        """Bytes of arguments a program: what one program streams if the work is even."""
        return self.bytes / max(self.programs, 1)


_STATE: dict[str, object] = {"log": None, "run": True, "order": None}


def current() -> list[Launch] | None:
    """The launches being recorded (:func:`recorded`), or None."""
    return _STATE["log"]


def as_on_gpu() -> bool:
    """Whether kernels are being recorded without running (tensors go to them as on a GPU)."""
    return _STATE["log"] is not None and not _STATE["run"]


def host_flag(flags: torch.Tensor) -> bool:
    """Whether any of ``flags`` is set, read on the host (a synchronisation on CUDA). While
    launches are recorded as on a GPU (:func:`as_on_gpu`: the cost model's trace, values
    garbage) the read is made, so that it is seen and charged, and False returned: the clean
    path is the one traced."""
    hit = bool(flags.any())
    return hit and not as_on_gpu()


def arg_bytes(values) -> int:
    spans: dict[int, int] = {}
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel() > 0:
            extent = 1 + sum((n - 1) * abs(s) for n, s in zip(v.shape, v.stride(), strict=True))
            spans[v.data_ptr()] = max(spans.get(v.data_ptr(), 0), extent * v.element_size())
    return sum(spans.values())


def _grid(executor, args_dev, kwargs) -> tuple[int, int, int]:
    grid = executor.grid
    if callable(grid):
        grid = grid(inspect.getcallargs(executor.fn, *args_dev, **kwargs))
    return tuple(int(g) for g in grid) + (1,) * (3 - len(grid))


def _orders(grid: tuple[int, int, int], how: str) -> list[tuple[int, int, int]]:
    ids = [(x, y, z) for x in range(grid[0]) for y in range(grid[1]) for z in range(grid[2])]
    if how == "reversed":
        return ids[::-1]
    if how == "gpu":  # blockIdx.x fastest
        return sorted(ids, key=lambda p: (p[2], p[1], p[0]))
    if how == "random":
        random.Random(0).shuffle(ids)
        return ids
    raise ValueError(f"program order {how!r}: 'reversed', 'gpu' or 'random'")


def _call(executor, original: Callable, *args_dev, **kwargs):
    log = _STATE["log"]
    if log is not None:
        kw = {k: v for k, v in kwargs.items() if k in inspect.getfullargspec(executor.fn).args}
        log.append(Launch(executor.fn.__name__, _grid(executor, args_dev, kw),
                          arg_bytes([*args_dev, *kw.values()])))  # fmt: skip
        if not _STATE["run"]:
            return None
    order = _STATE["order"]
    if order is None:
        return original(executor, *args_dev, **kwargs)
    return _run_in_order(executor, order, *args_dev, **kwargs)


def _run_in_order(executor, how: str, *args_dev, **kwargs):
    """The interpreter's executor with its programs in another order (its own loop otherwise)."""
    from triton.runtime import interpreter as it

    argspec = inspect.getfullargspec(executor.fn)
    kwargs = {k: v for k, v in kwargs.items() if k in argspec.args}
    args_hst, kwargs_hst = executor._init_args_hst(args_dev, kwargs)
    for hook in executor.pre_run_hooks:
        hook(*args_hst, **kwargs_hst)
    scope = it._patch_lang(executor.fn)
    try:
        args = inspect.getcallargs(executor.fn, *args_hst, **kwargs_hst)
        args = {n: a if n in executor.constexprs else it._implicit_cvt(a) for n, a in args.items()}
        grid = executor.grid(args) if callable(executor.grid) else executor.grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        it.interpreter_builder.set_grid_dim(*grid)
        for x, y, z in _orders(grid, how):
            it.interpreter_builder.set_grid_idx(x, y, z)
            executor.fn(**args)
    finally:
        scope.restore()
    executor._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    from triton.runtime import interpreter as it

    original = it.GridExecutor.__call__
    if getattr(original, "_attnchecker", False):  # nested: already patched
        yield
        return

    def call(self, *args, **kwargs):
        return _call(self, original, *args, **kwargs)

    call._attnchecker = True
    it.GridExecutor.__call__ = call
    try:
        yield
    finally:
        it.GridExecutor.__call__ = original


@contextlib.contextmanager
def recorded(run: bool = True) -> Iterator[list[Launch]]:
    """Every Triton launch while active, in order (the interpreter's; ``run=False``: recorded,
    not run)."""
    saved = dict(_STATE)
    _STATE.update(log=[], run=run)
    try:
        with _patched():
            yield _STATE["log"]
    finally:
        _STATE.update(saved)


@contextlib.contextmanager
def program_order(how: str) -> Iterator[None]:
    """Run every launch's programs in order ``how`` (see the module docstring)."""
    _orders((1, 1, 1), how)  # a bad name fails here
    saved = dict(_STATE)
    _STATE.update(order=how)
    try:
        with _patched():
            yield
    finally:
        _STATE.update(saved)


_SMALL = 1 << 16  # elements: ops on no more than this compute (step counters, the clock, scalars)


class SkipCompute(TorchDispatchMode):
    """Run torch code for its shapes only: each aten op that computes on more than a few
    thousand elements returns uninitialised tensors of the right shapes and strides (from the
    op's meta kernel), in-place ops return their argument untouched; views, small ops (step
    counters, the clock) and other packages' ops (the registered check ops) run.
    With :func:`recorded` (``run=False``) a training step's launches at full width cost
    allocations only. Values are garbage: record, never read."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if sum(t.numel() for t in tensors) <= _SMALL:  # counters, scalars: computed
            with contextlib.suppress(NotImplementedError):  # (a GPU's kernel: as the rest)
                return func(*args, **kwargs)
        if func.namespace != "aten" or any(r.alias_info is not None and not r.alias_info.is_write
                                           for r in schema.returns):  # fmt: skip
            return func(*args, **kwargs)  # views, and ops that are not aten's
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        if written:  # in place / out=: the argument, as it was
            if not schema.returns:  # (the in-place foreach ops return nothing)
                return None
            bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
            outs = [bound[n] for n in written]
            return outs[0] if len(schema.returns) == 1 else tuple(outs[: len(schema.returns)])
        if func is torch.ops.aten._local_scalar_dense.default:
            return func(*args, **kwargs)

        def meta(t):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            return t

        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        try:
            out = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        except (NotImplementedError, RuntimeError):  # no meta kernel: compute it
            return func(*args, **kwargs)

        def real(t):
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                           device=device or "cpu")  # fmt: skip
            return t

        return tree_map(real, out)
