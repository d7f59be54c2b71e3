"""The GPU cost model (``../shared/spec/gpu-path.md`` §7): a step's time on a GPU, modelled from
the work it dispatches on a machine without one. Every figure it gives is **modelled, not
measured**, and is to be labelled so.

The contract. Run one piece of work (a training step) under an :class:`OpTrace`: each launching
aten op (not a view, :data:`attnchecker.testing.VIEW_OPS`, nor an allocation) is recorded with
its FLOPs (``torch.utils.flop_counter``'s formulas: GEMMs, convolutions, attention kernels; 0
for the rest) and the bytes it moves (its tensor inputs and outputs, each once); a registered
op of attnchecker's is looked into: the aten ops it runs inside (casts, zero-fills, copies) are
recorded as the rest, and each Triton kernel it launches with its grid and the bytes of its
arguments (:mod:`attnchecker.kernels.launches`). On a :class:`Device` an aten op takes
max(bytes / bandwidth, FLOPs / FLOP rate, a kernel's floor); a Triton launch takes max(bytes /
min(bandwidth, programs x ``program_rate``), the floor), a repair that returns on a clean flag
(:func:`clean_exit`) the bytes of its flags only; each launch costs ``launch`` seconds of host
time in eager, none in a CUDA graph; :class:`Modelled` sums them: an eager step is the slower
of host and device (they overlap), a graph step the device's. :func:`traced_step` traces a
protected (or plain) llama's training step at any width on this machine in seconds: real
tensors, nothing computed (:class:`~attnchecker.kernels.launches.SkipCompute`), the GPU's path
taken where the CPU's differs (the SDPA route expands K / V for GQA on CUDA), so both arms of a
comparison are traced the same way.

What the model cannot see, and where it may be wrong:

- the device constants: ``bandwidth``, ``flops`` and ``kernel`` of :data:`H200` are rates
  kernels are taken to reach, never yet fitted to per-kernel timings on the device (the
  calibration rows of ``benchmarks/gpu_model.py`` were host-bound), and ``program_rate`` (what
  one program of a launch streams) is an assumption: the bandwidth shared by the SMs;
- how a kernel uses the machine beyond its grid: occupancy, tails, the L2, a serial loop
  inside a program (a launch is charged by its bytes and programs only);
- what a user's ``torch.compile`` runs: inductor fuses the traced ops its own way (a CUDA graph
  step stands in for a compiled one, launch cost gone; count the compiled kernels with
  :func:`attnchecker.testing.inductor_kernels`);
- the backend's choice on a GPU (flash or memory-efficient SDPA) and the model's own code paths
  there (transformers' GQA handling on CUDA is taken to be the CPU's: native).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass

import torch

from attnchecker.testing import VIEW_OPS, OpCounter

__all__ = [
    "H200",
    "LLAMA_8B",
    "Device",
    "Modelled",
    "OpTrace",
    "audit_failures",
    "launch_audit",
    "traced_step",
]


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
    program_rate: float = 0.0  # bytes / s one program of a Triton launch streams (0: any)
    sync: float = 30e-6  # s the device idles at a host read: the round trip, the next launch

    def triton_time(self, nbytes: float, programs: int) -> float:
        """A Triton launch's device time: its bytes at the rate its programs can reach."""
        rate = self.bandwidth if not self.program_rate else min(
            self.bandwidth, programs * self.program_rate)  # fmt: skip
        return max(nbytes / rate, self.kernel)


SMS = 132
"""Streaming multiprocessors of an H100 / H200: a launch with fewer programs leaves SMs idle."""

H200 = Device("H200", bandwidth=4.0e12, flops=7.0e14, kernel=3e-6, launch=20e-6,
              program_rate=4.0e12 / SMS)  # fmt: skip
"""The H200 of the committed runs (``benchmarks/results/gpu_2026-12-04``): 4.8 TB/s and ~990
TFLOP/s dense bf16 peak, taken at the rates kernels reach; ~20 us of host time per eager op was
measured there (llama: 46 ms for 2,329 extra ops); a program of a Triton launch at most its SM's
share of the bandwidth (an assumption, stated: the first GPU session measures it,
``scripts/gpu_check.sh``). ``benchmarks/gpu_model.py`` sets it against
those measured steps and states its error."""


@dataclass(frozen=True)
class Modelled:
    """A modelled step: its launching ops, host time, device time (seconds) and its host reads
    of device values (``syncs``), each ``sync_cost`` seconds of an idle device."""

    launches: int
    host: float
    device: float
    syncs: int = 0
    sync_cost: float = 0.0

    def step(self, graph: bool = False) -> float:
        """Eager: host and device overlap, the slower sets the pace, and each host read stalls
        the device; in a CUDA graph the host launches nothing (a step with host reads cannot
        be captured: NaN)."""
        if graph:
            return self.device if not self.syncs else math.nan
        return max(self.host, self.device) + self.syncs * self.sync_cost


_ALLOCATING = frozenset({"aten.empty", "aten.empty_like", "aten.empty_strided",
                         "aten.new_empty", "aten.new_empty_strided"})  # fmt: skip
"""Ops that allocate and launch no kernel (counted as launching by
:class:`attnchecker.testing.OpCounter`, which predates the model; left out of
:attr:`OpTrace.work`)."""


def clean_exit(kernel: str) -> bool:
    """Whether a Triton kernel is a repair (the SDPA route's, the GEMM checks'), whose programs
    each read a flag or a few and return on a clean step: charged those bytes
    (:data:`FLAG_BYTES` a program), not the tensors they would rewrite on a flag."""
    return "repair" in kernel


FLAG_BYTES = 128
"""Bytes a repair's program reads on a clean step (its flags): what :func:`clean_exit` kernels
are charged."""

_FLOPS_AS = {  # CPU kernels the FLOP counter does not know, counted as their CUDA twins
    "aten._scaled_dot_product_flash_attention_for_cpu":
        torch.ops.aten._scaled_dot_product_flash_attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward":
        torch.ops.aten._scaled_dot_product_flash_attention_backward,
}  # fmt: skip


class OpTrace(OpCounter):
    """An :class:`attnchecker.testing.OpCounter` that also keeps each launching aten op's FLOPs
    (the formulas of ``torch.utils.flop_counter``: GEMMs, convolutions, attention kernels; 0 for
    the rest) and the bytes it moves (its tensor inputs and outputs, each once), looks into
    attnchecker's registered ops (their aten ops traced as the rest, their Triton launches
    recorded: :attr:`launches`), and models the lot on a GPU (:meth:`modelled`). Allocations
    (``aten.empty`` and kin) launch nothing and are left out. Enter it inside
    :func:`attnchecker.kernels.launches.recorded` to see the Triton launches (``run=False`` with
    :class:`~attnchecker.kernels.launches.SkipCompute`: shapes only)."""

    def __init__(self) -> None:
        super().__init__()
        self.work: list[tuple[str, float, float]] = []  # (op, FLOPs, bytes) per launching op
        self.launches: list = []  # the Triton launches (attnchecker.kernels.launches.Launch)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "attnchecker":  # its work: the ops inside, and its launches
            from attnchecker.kernels import launches

            self.ops[str(func.overloadpacket)] += 1
            log = launches.current()
            before = 0 if log is None else len(log)
            from torch._library.custom_ops import OPDEFS

            body = OPDEFS[func._schema.name]._init_fn  # its Python body, traced op by op
            with self:
                out = body(*args, **kwargs)
            if log is not None:
                self.launches += log[before:]
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        op = str(func.overloadpacket)
        if op not in VIEW_OPS and op not in _ALLOCATING:
            from torch.utils._pytree import tree_leaves
            from torch.utils.flop_counter import flop_registry

            count = flop_registry.get(_FLOPS_AS.get(op, func.overloadpacket))
            flops = float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0
            seen = {id(t): t for t in tree_leaves((args, kwargs, out))
                    if isinstance(t, torch.Tensor)}  # fmt: skip
            moved = sum(t.numel() * t.element_size() for t in seen.values())
            self.work.append((op, flops, float(moved)))
        return out

    @property
    def launched(self) -> int:
        """Launching aten ops and Triton launches (a registered op is its launches)."""
        return len(self.work) + len(self.launches)

    def modelled(self, device: Device = H200) -> Modelled:
        """The traced work as a step on ``device``."""
        n = self.launched
        reads = sum(k for op, k in self.syncs.items() if op != "aten.lift_fresh")  # (host data)
        return Modelled(n, n * device.launch, sum(self.device_time(device).values()), reads,
                        device.sync)  # fmt: skip

    def device_time(self, device: Device = H200) -> Counter[str]:
        """Modelled device seconds per op name (Triton kernels as ``triton.<kernel>``)."""
        out: Counter[str] = Counter()
        for op, f, b in self.work:  # (a CPU kernel under its CUDA twin's name)
            twin = _FLOPS_AS.get(op)
            name = op if twin is None else f"aten.{twin.__name__.split('.')[0]}"
            out[name] += max(b / device.bandwidth, f / device.flops, device.kernel)
        for n in self.launches:
            nbytes = n.programs * FLAG_BYTES if clean_exit(n.kernel) else n.bytes
            out[f"triton.{n.kernel}"] += device.triton_time(nbytes, n.programs)
        return out


# ------------------------------------------------------------------------------ the launch audit

LLAMA_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "head_dim": 128}  # fmt: skip
"""Llama 3 8B's widths (head dim 128, GQA 4:1): what the launch audit and the model price."""

PER_PROGRAM_MAX = 2e6
"""Bytes of arguments a program may stream on its own (issue 54's rule): one program reaches
tens of GB/s, not the device's TB/s, so a launch over more than this a program is serial."""

FEW_PROGRAMS_MAX = 32e6
"""Bytes a launch with fewer programs than :data:`SMS` may touch."""


def traced_step(
    config=None,
    *,
    family: str = "llama",
    layers: int = 1,
    L: int = 4096,
    vocab: int = 32000,
    batch: int = 1,
    autocast: bool = True,
    micro_batches: int = 1,
    widths: dict | None = None,
    native_gqa: bool = False,
    fused: bool = False,
) -> OpTrace:
    """The :class:`OpTrace` of the second of two training steps of a ``layers``-layer
    ``family`` model at ``widths`` (:data:`LLAMA_8B` by default; ``{}``: base width), sequence
    ``L``, ``batch`` sequences a micro-batch, ``micro_batches`` of them a step (gradients
    accumulated), then AdamW (``foreach``, as on CUDA; ``fused``: the fused kernel, what
    :func:`attnchecker.guard` asks for; with ``"update"`` in the config's invariants, guarded:
    the update check), the gradients zeroed and, protected,
    the records drained: plain (``config`` None, SDPA attention) or protected by ``config`` (an
    :class:`~attnchecker.ABFTConfig`; ``backend="sdpa", check_impl="triton"`` is what ``auto``
    runs on CUDA). ``native_gqa``: the flash kernel takes K / V of fewer heads as they are
    (:data:`attnchecker.kernels.sdpa_backend.GQA_NATIVE`, probed on the device; else the route
    expands them). bf16 autocast over fp32 weights (``autocast``; else bf16 weights). Nothing is
    computed (:class:`~attnchecker.kernels.launches.SkipCompute`, the Triton launches recorded,
    not run, the GPU's path where it differs): seconds at widths this machine could not
    compute, the same way for both arms."""
    from attnchecker import protect_
    from attnchecker.kernels.launches import SkipCompute, recorded
    from attnchecker.models.tiny import build

    with torch.device("meta"):
        model = build(family, "base", layers=layers, max_len=L, vocab_size=vocab,
                      **(LLAMA_8B if widths is None else widths))  # fmt: skip
    model = model.to_empty(device="cpu")
    if not autocast:
        model = model.to(torch.bfloat16)
    with torch.no_grad():  # protect_'s probe compares real numbers
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
        for name, buf in model.named_buffers():  # indices (BERT's positions, token types)
            if not buf.is_floating_point():
                buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf) if name.endswith(
                    "position_ids") else torch.zeros_like(buf))  # fmt: skip
    model.config.use_cache = False
    model.train()
    model.set_attn_implementation("sdpa")
    # (values are garbage: the records may read as faults, so drain warns, silenced, not raises)
    handle = None if config is None else protect_(model, config.replace(policy="warn"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=not fused, fused=fused)
    if handle is not None and "update" in config.invariants:  # the update check: in the guard
        from attnchecker.recovery.guard import guard

        opt = guard(opt, handle)
    ids = torch.randint(3, 128, (batch, L), generator=torch.Generator().manual_seed(0))

    def step(trace: OpTrace | None) -> None:
        with SkipCompute(), recorded(run=False), trace or contextlib.nullcontext():
            for _ in range(micro_batches):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if handle is not None:
            with recorded(run=False), trace or contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                handle.drain()

    from attnchecker.kernels import sdpa_backend

    saved = dict(sdpa_backend.GQA_NATIVE)
    sdpa_backend.GQA_NATIVE["cpu"] = native_gqa  # (the GPU's path is traced on CPU tensors)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _as_on_cuda(sdpa)
    try:
        step(None)  # the first builds what is cached
        trace = OpTrace()
        step(trace)
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        sdpa_backend.GQA_NATIVE.clear()
        sdpa_backend.GQA_NATIVE.update(saved)
    return trace


def _as_on_cuda(sdpa):
    """``F.scaled_dot_product_attention`` as CUDA runs a call with dropout (the flash kernel
    without a mask in half precision, else the memory-efficient one, each drawing its own
    dropout), for the plain model traced on CPU tensors (where the call would take the math
    backend, L x L); calls without dropout as they are (the CPU's flash kernel, charged as
    CUDA's)."""

    def on_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):  # fmt: skip
        if dropout_p == 0:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)  # fmt: skip
        from attnchecker.kernels.sdpa_backend import backend_mask, expand_kv

        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16):
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, scale=scale)[0]  # fmt: skip
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, backend_mask(attn_mask, q), True, dropout_p, is_causal, scale=scale
        )[0]

    return on_cuda


def launch_audit(config, **kwargs) -> list:
    """Every Triton launch of :func:`traced_step`'s protected step (its keywords; one layer at
    Llama-8B widths, L 4096, by default), as :class:`~attnchecker.kernels.launches.Launch`es:
    :func:`audit_failures` applies the rules."""
    return traced_step(config, **kwargs).launches


def audit_failures(launches) -> list[str]:
    """The launches that break issue 54's rules: more than :data:`PER_PROGRAM_MAX` bytes of
    arguments a program, or fewer programs than :data:`SMS` over more than
    :data:`FEW_PROGRAMS_MAX` bytes."""
    out = []
    for n in launches:
        if n.per_program > PER_PROGRAM_MAX:
            out.append(f"{n.kernel} {n.grid}: {n.per_program / 1e6:.2f} MB a program")
        elif n.programs < SMS and n.bytes > FEW_PROGRAMS_MAX:
            out.append(f"{n.kernel} {n.grid}: {n.programs} programs over {n.bytes / 1e6:.0f} MB")
    return out
