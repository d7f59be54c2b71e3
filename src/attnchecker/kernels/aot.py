"""The fused kernels compiled ahead of time for CUDA GPUs, on a machine without one.

The interpreter runs code the compiler rejects or rewrites, so the kernels are also compiled
for real targets here: each :class:`Case` is launched through :mod:`attnchecker.kernels.flash`
on CPU tensors with the kernels' ``run`` replaced by a recorder (the launcher's own arguments,
constexprs and launch settings for that architecture), then specialised as Triton's launcher
does and compiled with ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` with the ptxas
that ships in the triton wheel (no GPU, no driver). A :class:`Report` per kernel holds ptxas'
registers, spills and stack frame, the shared memory against the target's limit, the number
of ``tt.dot`` before and after the TTIR passes (a merged recompute shows as fewer) and the
kernel arguments whose pointer offsets are computed in 32 bits. ::

    python -m attnchecker.kernels.aot --cases full --table benchmarks/results/kernel_ptxas.md

Needs ``TRITON_INTERPRET`` unset (the kernels must be decorated for compiling): the tests run
it in a subprocess. One compile takes 1-10 s on a CPU core.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

__all__ = ["GEMM_KERNELS", "SHARED_LIMIT", "Case", "Report", "cases", "compile_case",
           "compile_gemm_case", "gemm_cases", "main"]  # fmt: skip

KERNELS = ("fwd", "dkdv", "dq")
SHARED_LIMIT = {80: 166_912, 90: 232_448}
"""Shared memory one block may use (bytes): A100 163 KiB, H100 / H200 227 KiB."""
DTYPES = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class Case:
    """One launch configuration of the kernels (every value the compiled code depends on)."""

    dtype: str = "bf16"
    d: int = 64
    arch: int = 90
    causal: bool = True
    check: bool = True
    inject: bool = False
    mask: bool = False
    window: bool = False
    gqa: bool = False
    tf32: bool = False  # fp32 operands on TF32 MMAs (torch's allow_tf32)

    @property
    def name(self) -> str:
        flags = [f for f in ("causal", "check", "inject", "mask", "window", "gqa", "tf32")
                 if getattr(self, f)]  # fmt: skip
        return f"sm_{self.arch} {self.dtype} d{self.d} " + ("+".join(flags) or "plain")


@dataclass
class Report:
    """ptxas and IR figures of one kernel of one case (None where compiling failed)."""

    case: Case
    kernel: str
    launch: dict = field(default_factory=dict)  # BLOCK_M, BLOCK_N, BLOCK_D, warps, stages
    registers: int | None = None
    spill_stores: int | None = None  # bytes per thread
    spill_loads: int | None = None
    stack: int | None = None  # bytes of stack frame per thread
    shared: int | None = None  # bytes per block
    dots_source: int | None = None  # tt.dot the frontend IR executes (helpers per call)
    dots_ttir: int | None = None  # ... after the TTIR passes (CSE)
    narrow_offsets: list[str] = field(default_factory=list)  # pointer args offset in i32
    seconds: float = 0.0
    error: str | None = None

    @property
    def shared_ok(self) -> bool:
        return self.shared is not None and self.shared <= SHARED_LIMIT[self.case.arch]

    def row(self) -> dict:
        out = dataclasses.asdict(self)
        out["case"] = dataclasses.asdict(self.case)
        return out

    @classmethod
    def from_row(cls, row: dict) -> Report:
        return cls(**{**row, "case": Case(**row["case"])})


def cases(which: str = "test") -> list[Case]:
    """``"smoke"``: what ``make test`` compiles (one case: the production setting of bf16 at
    d 128 on sm_90; the GEMM checks' kernels always). ``"test"``: what ``make test-all``
    compiles: the production setting (checks on, causal with a
    padding mask, no injection) of fp16 / bf16 at d 64 and 128, fp32 at d 64 and fp32 on TF32
    at d 128, on sm_90 and sm_80 (sm_80 fp16 at d 128 and bf16 at d 64 left to the full set:
    they compile as their neighbours do), and every other launch option (no causal mask,
    sliding window, GQA, injection, checks off, an odd head size) at least once per
    architecture. ``"full"``: the cross product of architecture, dtype (fp32 with and without
    TF32) and head size 64 / 80 / 128, each checked, checked with injection and unchecked,
    plus the same options. fp32 without TF32 at d > 64 is compiled for the table but not
    launched by the fused backend (``flash.FP32_MAX_HEAD``)."""
    if which == "smoke":  # make test's: the production setting of bf16 at d 128 on sm_90
        return [Case("bf16", 128, 90, mask=True)]
    if which not in ("test", "full"):
        raise ValueError(f"cases must be 'smoke', 'test' or 'full', got {which!r}")
    chosen: list[Case] = []
    heads = (64, 128) if which == "test" else (64, 80, 128)
    kinds = [("fp16", False), ("bf16", False), ("fp32", False), ("fp32", True)]
    for arch, (dtype, tf32), d in itertools.product((90, 80), kinds, heads):
        if which == "test":
            if dtype == "fp32" and tf32 != (d > 64):
                continue
            if arch == 80 and (dtype, d) in (("fp16", 128), ("bf16", 64)):
                continue
        chosen.append(Case(dtype, d, arch, mask=True, tf32=tf32))
        if which == "full":
            chosen.append(Case(dtype, d, arch, mask=True, tf32=tf32, inject=True))
            chosen.append(Case(dtype, d, arch, check=False, tf32=tf32))
    for arch in (90, 80):  # each remaining option at least once per architecture
        chosen += [
            Case("bf16", 80, arch, causal=False, gqa=True, window=True),
            Case("fp16", 64, arch, check=False, inject=True),
            Case("bf16", 128, arch, inject=True, mask=True, gqa=True),
        ]
    return chosen


def launched(case: Case) -> bool:
    """Whether the fused backend launches the kernels for ``case`` (not fp32 without TF32
    above ``flash.FP32_MAX_HEAD``)."""
    from attnchecker.kernels.flash import FP32_MAX_HEAD

    return not (case.dtype == "fp32" and not case.tf32 and case.d > FP32_MAX_HEAD)


def _tensors(case: Case):
    import torch

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    B, H, L = 2, 4, 512  # long enough for every block cap
    Hkv = 2 if case.gqa else H
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, case.d, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, L, case.d, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(B, L, dtype=torch.bool) if case.mask else None
    return q, k, v, mask


def _capture(case: Case) -> dict[str, tuple]:
    """{kernel: (JITFunction, args, kwargs)} as flash.py launches them for ``case``."""
    import torch

    from attnchecker.kernels import flash
    from attnchecker.kernels import flash_bwd as bwd
    from attnchecker.kernels import flash_fwd as fwd

    fns = {"fwd": fwd.fwd_kernel, "dkdv": bwd.dkdv_kernel, "dq": bwd.dq_kernel}
    seen: dict[str, tuple] = {}
    q, k, v, mask = _tensors(case)
    fault = torch.zeros(8) if case.inject else None  # encoded: any site sets INJECT
    kw = dict(causal=case.causal, key_mask=mask, window=128 if case.window else 0,
              check=case.check, fault=fault)  # fmt: skip
    matmul = torch.backends.cuda.matmul
    tf32 = matmul.allow_tf32
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(flash, "device_arch", return_value=case.arch))
        for name, fn in fns.items():
            stack.enter_context(mock.patch.object(fn, "run", _recorder(seen, name, fn)))
        try:
            matmul.allow_tf32 = case.tf32
            _out, lse, _ = flash.flash_forward(q, k, v, **kw)
            flash.flash_backward(q, k, v, q.clone(), lse, q.clone(), **kw)
        finally:
            matmul.allow_tf32 = tf32
    return seen


_PTXAS = {
    "registers": r"Used (\d+) registers",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
}


def _narrow(ttir: str, fn) -> list[str]:
    """Tensor arguments of ``fn`` that some ``tt.addptr`` offsets by an i32 scalar (an offset
    that wraps past 2^31 elements); the counters, the fault vector, the GEMM checks' record
    rows, log and clock, a few fixed elements addressed by constants, are not tensors of the
    problem's size."""
    pointers = [p.name for p in fn.params if not p.is_constexpr and p.name[0].isupper()
                and p.name not in ("COUNTS", "FAULT", "REC", "STEP", "LOG")]  # fmt: skip
    found = set()
    for name in pointers:
        if re.search(rf"tt\.addptr %{name}, %[\w.]+ : !tt\.ptr<[^>]+>, i32\b", ttir):
            found.add(name)
    return sorted(found)


_FUNC = re.compile(r'tt\.func (public|private) @("[^"]+"|[\w.]+)\(')
_CALLS = re.compile(r'tt\.call @("[^"]+"|[\w.]+)\(')


def _dots(source: str) -> int:
    """The ``tt.dot`` a kernel's frontend IR executes: its own plus those of every jit function
    it calls, once per call (a helper holding one GEMM, called twice, is two; the TTIR has them
    inlined)."""
    bodies, entry, name = {}, None, None
    for line in source.splitlines():
        m = _FUNC.search(line)
        if m:
            name = m.group(2)
            bodies[name] = []
            entry = entry or (name if m.group(1) == "public" else None)
        elif name is not None:
            bodies[name].append(line)

    def count(fn: str, seen: tuple[str, ...] = ()) -> int:
        if fn in seen:  # recursion is impossible in Triton; a parse error must not loop
            raise ValueError(f"cyclic calls through {fn} in the frontend IR")
        text = "\n".join(bodies.get(fn, ()))
        return text.count("tt.dot ") + sum(count(c, (*seen, fn)) for c in _CALLS.findall(text))

    return count(entry) if entry else source.count("tt.dot ")


def compile_case(case: Case) -> list[Report]:
    """Compile the three kernels of ``case``; a failure is a report's ``error``."""
    try:
        seen = _capture(case)
    except Exception as exc:  # a launcher that rejects the case
        return [Report(case, k, error=f"launch: {type(exc).__name__}: {exc}") for k in KERNELS]
    return [_compile(case, kernel, *seen[kernel]) for kernel in KERNELS]


GEMM_KERNELS = ("gemm_refs", "gemm_verify", "gemm_repair", "proj_weights", "proj_verify",
                "proj_repair", "sdpa_kv_stats", "sdpa_fwd_verify", "sdpa_fwd_repair",
                "sdpa_bwd_q", "sdpa_bwd_kv", "sdpa_bwd_check", "sdpa_bwd_repair_q",
                "sdpa_bwd_repair_kv", "acc_mm", "inv_row_sums", "inv_norm_excess",
                "inv_checked_adamw")  # fmt: skip
"""The Triton kernels of the GEMM checks (:mod:`attnchecker.kernels.gemm_check`,
:mod:`attnchecker.kernels.projection_check`), of the SDPA route's checks
(:mod:`attnchecker.kernels.sdpa_kernels`), the accumulator GEMM
(:mod:`attnchecker.kernels.acc_gemm`) and the checks beyond the GEMMs
(:mod:`attnchecker.kernels.invariants`: the update check's row sums, the norms' excess, the
checked AdamW)."""


def gemm_cases() -> list[Case]:
    """The GEMM check's kernels depend on the architecture and the operands' dtype only: every
    dtype on sm_90 and sm_80 (``Case.d``, the head size, is 0; about 0.3 s a kernel)."""
    return [Case(dtype, 0, arch, causal=False) for arch in (90, 80) for dtype in DTYPES]


def compile_gemm_case(case: Case) -> list[Report]:
    """Compile the GEMM checks' kernels for ``case``'s architecture and dtype, as
    :func:`attnchecker.kernels.gemm_check.check_` launches them (M 1,000, K 768, N 2,304) and
    :func:`attnchecker.kernels.projection_check.check_` (a fused Q | K | V of 36 heads of 64)."""
    import torch

    from attnchecker.abft.norm import NormSpec
    from attnchecker.kernels import acc_gemm as ag
    from attnchecker.kernels import gemm_check as gc
    from attnchecker.kernels import invariants as inv
    from attnchecker.kernels import projection_check as pc
    from attnchecker.kernels import sdpa_kernels as sk
    from attnchecker.kernels import sdpa_kernels_bwd as sb

    kernels = (gc.refs_kernel, gc.verify_kernel, gc.repair_kernel, pc.weights_kernel,
               pc.verify_kernel, pc.repair_kernel, sk.kv_stats_kernel, sk.fwd_verify_kernel,
               sk.fwd_repair_kernel, sb.bwd_q_kernel, sb.bwd_kv_kernel, sb.bwd_check_kernel,
               sb.bwd_repair_q_kernel, sb.bwd_repair_kv_kernel, ag.mm_kernel,
               inv.row_sums_kernel, inv.norm_excess_kernel, inv.checked_adamw_kernel)  # fmt: skip
    fns = dict(zip(GEMM_KERNELS, kernels, strict=True))
    seen: dict[str, tuple] = {}
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[case.dtype]
    x, y = torch.zeros(1000, 768, dtype=dtype), torch.zeros(768, 2304, dtype=dtype)
    with contextlib.ExitStack() as stack:
        for name, fn in fns.items():
            stack.enter_context(mock.patch.object(fn, "run", _recorder(seen, name, fn)))
        rec, step = torch.zeros(7, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        gc.check_(x @ y, x, y, rec, step, floor=0.0, a=4e-3, c=-1e-6, cap=48.0)
        w, b = y.t().contiguous(), torch.zeros(2304, dtype=dtype)  # (N, K), (N,)
        ws = pc.proj_weights(w, b, 36, False)
        pc.check_(x @ y, x, w, b, False, ws, (0,) * 12 + (1,) * 12 + (2,) * 12,
                  torch.zeros(3, 7, dtype=torch.float64), step, [0, 1, 2], factor=1e-3,
                  floor=0.0, absf=4e-3, cap=8.0)  # fmt: skip
        _sdpa_launches(sk, sb, dtype, step)
        # the accumulator GEMM with a bias (its repair, gemm_repair's bias variant, replaces
        # the plain one captured above: the same kernel with the bias's add)
        ag.checked_mm(x, y, torch.zeros(2304, dtype=dtype), rec, step)
        # AdamW's row sums after a step (parameter, moments, r) of a 4,096-wide fp32 weight; a
        # LayerNorm's check over rows of 4,096 in the case's dtype (the widest variant of each)
        p = torch.zeros(64, 4096)
        inv.row_sums(p, p, p, adam=(1.0, 1e-8), kernel=True)
        spec = NormSpec("layer", 1e-5)
        h, w = torch.zeros(64, 4096, dtype=dtype), torch.zeros(4096, dtype=dtype)
        inv.norm_excess(spec, h, h, w, w, kernel=True)
        coef = torch.ones(5, dtype=torch.float64)
        inv.checked_adamw(p, p, p.clone(), p.clone(), coef, 0.99, 0.9, 0.999, 1e-8)
    return [_compile(case, kernel, *seen[kernel]) for kernel in GEMM_KERNELS]


def _sdpa_launches(sk, sb, dtype, step) -> None:
    """The SDPA route's eight kernels as a causal GQA call launches them, with an additive mask
    (B 2, 32 heads over 8, L 1,000, d 128)."""
    import torch

    q = torch.zeros(2, 32, 1000, 128, dtype=dtype)
    k = v = torch.zeros(2, 8, 1000, 128, dtype=dtype)
    lse, rowmax = torch.zeros(2, 32, 1000), torch.zeros(1, 1, 1000)
    mask = torch.zeros(2, 1, 1000, 1000, dtype=dtype)
    log, rec = torch.zeros(2, 7, dtype=torch.float64), torch.zeros(3, 7, dtype=torch.float64)
    stats = sk.kv_stats(k, v)
    flags = sk.fwd_verify(q, k, q, lse, stats, rowmax, 0.09, 1.0)
    sk.fwd_repair(q, k, v, mask, q, lse, stats, rowmax, flags, log, step, (0, 1), True, 0.09,
                  1.0)  # fmt: skip
    part, qflags = sb.bwd_rows(q, k, lse, q, q, stats, rowmax, 0.09, 1.0)
    sums = sb.bwd_cols(k, v)
    sb.bwd_repair(q, k, v, mask, q, lse, q, q, k, v, stats, rowmax, part, qflags, sums, rec,
                  step, (0, 1, 2), True, 0.09, 1.0)  # fmt: skip


def _recorder(seen: dict, name: str, fn):
    def run(*args, grid, warmup, **kwargs):
        seen[name] = (fn, args, kwargs)

    return run


def _compile(case: Case, kernel: str, fn, args: tuple, kwargs: dict) -> Report:
    """Specialise one captured launch as Triton's launcher does and compile it for ``case``'s
    architecture; ptxas' figures, the shared memory and the IR's figures into a report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    knobs.nvidia.dump_ptxas_log = True
    target = GPUTarget("cuda", case.arch, 32)
    backend = make_backend(target)
    # the tile: (BLOCK_M, BLOCK_N) of an attention kernel, (BM, BN), (BK, BN) or (BM, BK) of
    # the GEMM check's; warps and stages Triton's defaults where the launcher sets none
    first, second = ("BLOCK_M", "BM", "BK", "CH"), ("BLOCK_N", "BN", "BK")
    launch = {"BLOCK_M": next((kwargs[k] for k in first if k in kwargs), None),
              "BLOCK_N": next((kwargs[k] for k in second if k in kwargs), None),
              "BLOCK_D": kwargs.get("BLOCK_D", kwargs.get("BD")),
              "num_warps": kwargs.get("num_warps", "default"),
              "num_stages": kwargs.get("num_stages", "default")}  # fmt: skip
    rep = Report(case, kernel, launch=launch)
    start = time.perf_counter()
    log = io.StringIO()
    try:
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
        # a fresh cache each time: a cached kernel (two cases that specialise alike, d 80 and
        # d 128 share BLOCK_D) would not run ptxas, so it would not report
        with tempfile.TemporaryDirectory(prefix="attnchecker-aot-") as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            with contextlib.redirect_stdout(log):
                ck = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                    target=target, options=options.__dict__)  # fmt: skip
    except Exception as exc:
        rep.error = f"{type(exc).__name__}: {_first_line(exc)}"
    else:
        text = log.getvalue()
        for key, pattern in _PTXAS.items():
            m = re.search(pattern, text)
            setattr(rep, key, int(m.group(1)) if m else None)
        rep.shared = int(ck.metadata.shared)
        rep.dots_source = _dots(ck.asm["source"]) if "source" in ck.asm else None
        rep.dots_ttir = ck.asm["ttir"].count("tt.dot ")
        rep.narrow_offsets = _narrow(ck.asm["ttir"], fn)
    rep.seconds = round(time.perf_counter() - start, 2)
    return rep


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    named = [line for line in text.splitlines() if "Error" in line]
    return (named[-1] if named else text.splitlines()[0] if text else "")[:300]


def compile_all(chosen: list[Case], jobs: int = 2, gemm: list[Case] = ()) -> list[Report]:
    """Every case of the attention kernels (``chosen``) and of the GEMM check's (``gemm``) in
    ``jobs`` processes, each compile with a fresh Triton cache (so ptxas runs and reports); the
    order is kept."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile with TRITON_INTERPRET unset (the kernels are interpreted)")
    work = [(False, c) for c in chosen] + [(True, c) for c in gemm]
    if jobs <= 1:
        return [r for job in work for r in _job(job)]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return [r for reports in pool.map(_job, work) for r in reports]


def _job(job: tuple[bool, Case]) -> list[Report]:
    is_gemm, case = job
    return compile_gemm_case(case) if is_gemm else compile_case(case)


def table(reports: list[Report]) -> str:
    """A markdown table of the reports, one row per kernel and case."""
    head = ("| case | kernel | blocks M x N | warps | stages | registers | spill st/ld B | "
            "stack B | shared KiB (limit) | tt.dot src -> ttir | i32 offsets | s |")  # fmt: skip
    lines = [head, "|" + "---|" * 12]
    for r in reports:
        if r.error:
            lines.append(f"| {r.case.name} | {r.kernel} | error: {r.error} |" + " |" * 10)
            continue
        lim = SHARED_LIMIT[r.case.arch] / 1024
        lines.append(
            f"| {r.case.name} | {r.kernel} | {r.launch['BLOCK_M']} x {r.launch['BLOCK_N']} | "
            f"{r.launch['num_warps']} | {r.launch['num_stages']} | {r.registers} | "
            f"{r.spill_stores} / {r.spill_loads} | {r.stack} | "
            f"{r.shared / 1024:.1f} ({lim:.0f}) | {r.dots_source} -> {r.dots_ttir} | "
            f"{', '.join(r.narrow_offsets) or '-'} | {r.seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m attnchecker.kernels.aot", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--cases", default="test", choices=("smoke", "test", "full"))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", type=Path, help="write the reports as JSON rows")
    p.add_argument("--table", type=Path, help="write a markdown table")
    args = p.parse_args(argv)
    chosen, gemm = cases(args.cases), gemm_cases()
    print(
        f"compiling {len(chosen)} cases x {len(KERNELS)} attention kernels and {len(gemm)} x "
        f"{len(GEMM_KERNELS)} GEMM check kernels in {args.jobs} processes",
        file=sys.stderr,
    )
    start = time.perf_counter()
    reports = compile_all(chosen, args.jobs, gemm)
    took = time.perf_counter() - start
    if args.json:
        args.json.write_text(json.dumps([r.row() for r in reports], indent=1))
    text = table(reports)
    if args.table:
        args.table.write_text(text)
    print(text)
    print(f"{len(reports)} kernels in {took:.0f} s", file=sys.stderr)
    return 1 if any(r.error for r in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
