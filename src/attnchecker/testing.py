"""Helpers for tests and benchmarks (like ``torch.testing``), not part of the protection:
counting the aten ops a piece of work dispatches, the kernels a compiled program calls
(:func:`inductor_kernels`), and clean protected training runs that count false alarms
(:func:`clean_run`).

On a GPU every dispatched op that computes something is a kernel launch of a few microseconds,
so for small per-layer work the count, not the FLOPs, sets the cost. Views and other metadata
ops (:data:`VIEW_OPS`) launch nothing; :class:`OpCounter` reports both the total a dispatch
mode sees and the launching part. The time of those launches on a GPU is modelled by
:mod:`attnchecker.gpu_cost`, which builds on :class:`OpCounter`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "SYNCING_OPS", "VIEW_OPS", "CleanRun", "KernelCalls", "OpCounter", "clean_run", "count_ops",
    "inductor_kernels",
]  # fmt: skip

VIEW_OPS = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.unsqueeze",
        "aten.squeeze", "aten.squeeze_", "aten.slice", "aten.select", "aten.expand",
        "aten.alias", "aten.detach", "aten.as_strided", "aten.permute", "aten.split",
        "aten.split_with_sizes", "aten.unbind", "aten.narrow", "aten.lift_fresh",
        "aten._reshape_alias", "aten.view_as", "aten.diagonal",
        "profiler._record_function_enter_new", "profiler._record_function_exit",
        "prim.device",  # a device query (FakeTensorMode dispatches it)
    }
)  # fmt: skip
"""Ops that only make a new view of existing memory (or mark a profiler range)."""


SYNCING_OPS = frozenset(
    {
        "aten._local_scalar_dense",  # .item(), bool(tensor), int(tensor)
        "aten.nonzero",  # data-dependent shapes synchronise on accelerators
        "aten.masked_select",
        "aten.is_nonzero",
        # a tensor built from host data (torch.tensor / as_tensor): on CUDA a copy from
        # pageable host memory, which waits for the stream (CUDA's sync detector flags it)
        "aten.lift_fresh",
    }
)
"""Ops that make the host wait for the device."""


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active, by ``aten.<name>`` (overloads merged), and apart
    the ops of check regions (:mod:`attnchecker.attention.regions`; under a dispatch mode a region
    runs its eager ops, each call tagged by :meth:`region`): what a compiled region replaces
    by its few kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.region_calls: Counter[str] = Counter()  # calls of each check region
        self.region_ops: Counter[str] = Counter()  # ops dispatched inside check regions
        self._region: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = str(func.overloadpacket)
        self.ops[op] += 1
        if self._region is not None:
            self.region_ops[op] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def region(self, name: str, impl: str = "compiled") -> Iterator[None]:
        """Tag the ops dispatched inside as one call of the check region ``name``, which runs
        as ``impl`` outside the counter (``"eager"``: its ops count as ops outside regions)."""
        self.region_calls[name] += 1
        outer = self._region
        self._region = name if impl == "compiled" else outer
        try:
            yield
        finally:
            self._region = outer

    @property
    def launching_outside_regions(self) -> int:
        """Launching ops outside check regions (a compiled region is its kernels instead)."""
        inside = sum(n for op, n in self.region_ops.items() if op not in VIEW_OPS)
        return self.launching - inside

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def syncs(self) -> dict[str, int]:
        """How often each host-synchronising op (:data:`SYNCING_OPS`) ran."""
        return {op: n for op, n in self.ops.items() if op in SYNCING_OPS}

    @property
    def launching(self) -> int:
        """Ops that compute something (a kernel launch on an accelerator)."""
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)


def count_ops(fn: Callable[[], object]) -> OpCounter:
    """Run ``fn`` once under an :class:`OpCounter` and return the counter."""
    with OpCounter() as counter:
        fn()
    return counter


class KernelCalls(Counter):
    """Kernel calls in the output code of the graphs inductor produced, by kind: ``generated``
    (its own fused kernels: C++ on CPU, Triton on CUDA), ``extern`` (library calls: GEMMs,
    ``extern_kernels.*``) and ``fallback`` (aten ops it does not lower, ``torch.ops.*``)."""

    @property
    def total(self) -> int:
        return sum(self.values())


_CALL = re.compile(
    r"^\s+(?:[\w, ]+=\s*)?"  # an optional assignment, then the callee:
    r"((?:cpp_fused|triton_)\w*(?:\.run)?|extern_kernels\.\w+|torch\.ops\.[\w.]+)\(",
    re.M,
)


def kernel_calls(code: str) -> KernelCalls:
    """The kernel calls of one graph's output code (the body of its ``call``: each runs once
    per execution of the graph)."""
    start = code.find("def call(")
    body = code[start:] if start >= 0 else code
    end = body.find("\ndef ", 1)
    body = body if end < 0 else body[:end]
    calls = KernelCalls()
    for name in _CALL.findall(body):
        kind = (
            "extern"
            if name.startswith("extern")
            else "fallback"
            if name.startswith("torch")
            else "generated"
        )
        calls[kind] += 1
    return calls


@contextlib.contextmanager
def inductor_kernels() -> Iterator[KernelCalls]:
    """Count the kernel calls of every graph inductor compiles, or loads from its cache, while
    active (a count, not a time). Run one step of a compiled model inside it, its first (which
    compiles its forward and backward graphs): the count is the kernels one step launches, as
    long as each graph runs once per step. Unlike ``torch._inductor.utils.run_and_get_code``
    it does not reset dynamo (models compiled before stay compiled)."""
    from torch._inductor.graph import GraphLowering

    calls = KernelCalls()
    with mock.patch.object(
        GraphLowering, "save_output_code", lambda code: calls.update(kernel_calls(code))
    ):
        yield calls


def _variant(obj: object) -> object:
    """A hashable key of what a compiled region specialises on: tensors' metadata, constants,
    functions' code and closures (a region compiles one variant per key, or fewer)."""
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.device.type)
    if isinstance(obj, list | tuple):
        return tuple(_variant(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _variant(v)) for k, v in sorted(obj.items()))
    if dataclasses.is_dataclass(obj):
        return tuple(_variant(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if callable(obj) and hasattr(obj, "__code__"):
        cells = tuple(_variant(c.cell_contents) for c in obj.__closure__ or ())
        return (obj.__code__, cells)
    return obj if isinstance(obj, int | float | bool | str | type(None)) else type(obj)


@contextlib.contextmanager
def region_kernels() -> Iterator[KernelCalls]:
    """Count the kernels the compiled check regions (:mod:`attnchecker.attention.regions`) launch
    while active, call by call: each call counts the kernels of its variant's output code,
    read when that variant compiles (dynamo is reset on entry, so each compiles here; run
    the work with ``check_impl="compiled"``). A region traced inside a user's compiled model
    is part of that model's graph (:func:`inductor_kernels`)."""
    from attnchecker.attention import regions

    torch._dynamo.reset()
    regions._compiled.cache_clear()
    real = regions._compiled
    total, seen = KernelCalls(), {}

    def compiled(fn):
        inner = real(fn)

        def call(*args, **kwargs):
            key = (fn.__qualname__, _variant(args), _variant(kwargs))
            if key in seen:
                out = inner(*args, **kwargs)
            else:
                with inductor_kernels() as calls:
                    out = inner(*args, **kwargs)
                seen[key] = KernelCalls(calls)
            total.update(seen[key])
            return out

        return call

    with mock.patch.object(regions, "_compiled", compiled):
        yield total
    regions._compiled.cache_clear()


@dataclass(frozen=True)
class CleanRun:
    """A fault-free protected training run: every event it raised is a false alarm."""

    family: str
    dtype: str
    steps: int
    events: int  # detections drained over the run (each step drained; an event counts its count)
    uncorrectable: int  # of them, reported uncorrectable
    loss_first: float
    loss_last: float
    norm_drift: float  # largest |w - w_0| over the weights of every norm layer (they moved)


def clean_run(
    family: str,
    *,
    dtype: str = "fp32",
    steps: int = 70,
    lr: float = 5e-3,
    outliers: float = 30.0,
    seq_len: int = 64,
    batch: int = 4,
    seed: int = 0,
    scope: str = "attention",
) -> CleanRun:
    """Train a protected tiny ``family`` model on Shakespeare under real dynamics and count its
    events: AdamW at a high learning rate (every norm weight moves: LayerNorm, RMSNorm, q_norm
    / k_norm), ``outliers`` times larger values in two embedding features (the massive
    activations of trained LLMs), fp32, or bf16 / fp16 autocast (``dtype="bf16"`` / ``"fp16"``);
    ``scope`` as :class:`~attnchecker.ABFTConfig`'s."""
    import warnings

    import torch

    from attnchecker import ABFTConfig, protect_
    from attnchecker.models.tiny import build
    from attnchecker.train.data import TokenBlocks, load_corpus, tokenizer_for

    low = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in low:
        raise ValueError(f"dtype must be one of {list(low)}, got {dtype!r}")
    corpus = load_corpus()
    blocks = TokenBlocks.build(corpus, tokenizer_for(corpus, 512), seq_len)
    model = build(family, vocab_size=blocks.vocab_size, max_len=seq_len, seed=seed)
    model.train()
    with torch.no_grad():
        model.get_input_embeddings().weight[:, :2] *= outliers
    norms = {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if "norm" in n.rsplit(".", 2)[-2].lower() or n.rsplit(".", 2)[-2].startswith("ln")
    }
    # policy="warn": every false alarm of the run is counted (the default, "raise", would stop
    # at the first); the checks are the default config's
    handle = protect_(model, ABFTConfig(scope=scope, policy="warn"))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    events, uncorrectable, losses = 0, 0, []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*uncorrectable", RuntimeWarning)
        for step in range(steps):
            ids, _ = blocks.batch(step, batch, seed)
            with torch.autocast(
                "cpu", dtype=low[dtype] or torch.bfloat16, enabled=bool(low[dtype])
            ):
                loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            found = handle.drain()
            events += sum(e.count for e in found)
            uncorrectable += sum(e.count for e in found if e.action == "uncorrectable")
            losses.append(float(loss.detach()))
    params = {n: p.detach() for n, p in model.named_parameters()}
    drift = max((float((params[n] - w).abs().max()) for n, w in norms.items()), default=0.0)
    return CleanRun(family, dtype, steps, events, uncorrectable, losses[0], losses[-1], drift)
