"""The GPU cost model (``../shared/spec/gpu-path.md`` §7): a step's time on a GPU, modelled from
the ops it dispatches on a machine without one. Every figure it gives is **modelled, not
measured**, and is to be labelled so.

The contract. Run one piece of work (a training step) under an :class:`OpTrace`: each launching
op (not a view, :data:`attnchecker.testing.VIEW_OPS`, nor an allocation) is recorded with its
FLOPs (``torch.utils.flop_counter``'s formulas: GEMMs, convolutions, attention kernels; 0 for the
rest) and the bytes it moves (its tensor inputs and outputs, each once). On a :class:`Device`
each op takes max(bytes / bandwidth, FLOPs / FLOP rate, a kernel's floor), and ``launch`` seconds
of host time in eager, none in a CUDA graph; :class:`Modelled` sums them: an eager step is the
slower of host and device (they overlap), a graph step the device's. The trace needs shapes, not
values: it runs on real tensors, on the meta device and under ``FakeTensorMode`` (a step at
widths this machine cannot hold). :data:`H200` is calibrated against measured H200 steps
(``benchmarks/gpu_model.py`` states the error), which were host-bound: the device constants have
not yet been tested against per-kernel timings.

What a trace cannot see:

- the work inside a registered op (its casts, zero-fills, the copies it makes): it is one op,
  charged for the tensors it takes and returns; a repair that waits for a device flag
  (:data:`_ON_A_FLAG`) is charged the kernel floor alone, as on a clean step;
- how a kernel uses the machine: every op is taken to reach the full bandwidth, so a launch of a
  few programs over many bytes is priced like a pass over the whole device;
- what a user's ``torch.compile`` runs: inductor fuses the traced ops its own way (a CUDA graph
  step stands in for a compiled one, launch cost gone; count the compiled kernels with
  :func:`attnchecker.testing.inductor_kernels`);
- what fake tensors change: under ``FakeTensorMode`` transformers builds the causal mask in full
  and repeats K/V for GQA in the plain model, which a real run does not; trace both arms of a
  comparison the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from attnchecker.testing import VIEW_OPS, OpCounter

__all__ = ["H200", "Device", "Modelled", "OpTrace"]


@dataclass(frozen=True)
class Device:
    """A GPU as :class:`OpTrace` models it (``../shared/spec/gpu-path.md`` §7): a kernel takes
    max(bytes / ``bandwidth``, FLOPs / ``flops``, ``kernel``) on the device, and each launching
    op ``launch`` seconds of host time in eager (none in a CUDA graph)."""

    name: str
    bandwidth: float  # bytes / s that a memory-bound kernel reaches
    flops: float  # FLOP / s that a large bf16 GEMM reaches
    kernel: float  # s: the least a kernel takes on the device
    launch: float  # s of host time per launching op, eager


H200 = Device("H200", bandwidth=4.0e12, flops=7.0e14, kernel=3e-6, launch=20e-6)
"""The H200 of the committed runs (``benchmarks/results/gpu_2026-12-04``): 4.8 TB/s and ~990
TFLOP/s dense bf16 peak, taken at the rates kernels reach; ~20 us of host time per eager op was
measured there (llama: 46 ms for 2,329 extra ops). ``benchmarks/gpu_model.py`` sets it against
those measured steps and states its error."""


@dataclass(frozen=True)
class Modelled:
    """A modelled step: its launching ops, host time and device time (seconds)."""

    launches: int
    host: float
    device: float

    def step(self, graph: bool = False) -> float:
        """Eager: host and device overlap, the slower sets the pace; in a CUDA graph the host
        launches nothing."""
        return self.device if graph else max(self.host, self.device)


_ALLOCATING = frozenset({"aten.empty", "aten.empty_like", "aten.empty_strided",
                         "aten.new_empty", "aten.new_empty_strided"})  # fmt: skip
"""Ops that allocate and launch no kernel (counted as launching by
:class:`attnchecker.testing.OpCounter`, which predates the model; left out of
:attr:`OpTrace.work`)."""


_ON_A_FLAG = frozenset({"attnchecker.gemm_repair", "attnchecker.proj_repair",
                        "attnchecker.sdpa_fwd_repair", "attnchecker.sdpa_bwd_repair",
                        "attnchecker.sdpa_fwd_repair_triton",
                        "attnchecker.sdpa_bwd_repair_triton"})  # fmt: skip
"""Registered ops whose work waits for a device flag (the GEMM checks' and the SDPA route's
repairs, as their Triton kernels run on CUDA): on a clean step each program reads a few flags
and returns, so :class:`OpTrace` counts no bytes for them (the kernel floor), not the tensors
they would rewrite on a flag."""


_FLOPS_AS = {  # CPU kernels the FLOP counter does not know, counted as their CUDA twins
    "aten._scaled_dot_product_flash_attention_for_cpu":
        torch.ops.aten._scaled_dot_product_flash_attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward":
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}  # fmt: skip


class OpTrace(OpCounter):
    """An :class:`attnchecker.testing.OpCounter` that also keeps each launching op's FLOPs (the
    formulas of ``torch.utils.flop_counter``: GEMMs, convolutions, attention kernels; 0 for the
    rest) and the bytes it moves (its tensor inputs and outputs, each once; none for an op that
    waits for a device flag, :data:`_ON_A_FLAG`, on a clean step): enough to model its time
    on a GPU (:meth:`modelled`). Works on real tensors, on the meta device and under
    ``FakeTensorMode`` (shapes only: a training step at widths this machine cannot hold).
    Allocations (``aten.empty`` and kin) launch nothing and are left out."""

    def __init__(self) -> None:
        super().__init__()
        self.work: list[tuple[str, float, float]] = []  # (op, FLOPs, bytes) per launching op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        op = str(func.overloadpacket)
        if op not in VIEW_OPS and op not in _ALLOCATING:
            from torch.utils._pytree import tree_leaves
            from torch.utils.flop_counter import flop_registry

            count = flop_registry.get(_FLOPS_AS.get(op, func.overloadpacket))
            flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
            seen = {id(t): t for t in tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor)}  # fmt: skip
            moved = (
                0 if op in _ON_A_FLAG else sum(t.numel() * t.element_size() for t in seen.values())
            )
            self.work.append((op, flops, float(moved)))
        return out

    def modelled(self, device: Device = H200) -> Modelled:
        """The traced work as a step on ``device``."""
        return Modelled(len(self.work), len(self.work) * device.launch,
                        sum(self.device_time(device).values()))  # fmt: skip

    def device_time(self, device: Device = H200) -> Counter[str]:
        """Modelled device seconds per op name (where a step's device time goes)."""
        out: Counter[str] = Counter()
        for op, f, b in self.work:
            out[op] += max(b / device.bandwidth, f / device.flops, device.kernel)
        return out
