"""Time the fused kernels' launch settings on a GPU: the candidates for ``kernels.flash.LAUNCH``.

``LAUNCH`` was chosen from ptxas reports alone (no spills, shared memory within the limit); this
times each candidate of a grid (query tile x key tile x warps x pipeline stages) for the
forward, the dK/dV and the dQ kernel, checked (what ``backend="triton"`` runs), bf16, causal,
B 2 x H 16 x L 4096 by default, with ``triton.testing.do_bench``. The dK/dV and dQ candidates
are timed as the whole backward with the other kernel at its current setting (a constant
added to every candidate of the kernel). Each checked candidate's counters must stay 0: a
tile size changes the tolerances' lengths, so a setting with false alarms is reported as such.

The candidates are compiled first by ``--jobs`` worker processes (Triton's disk cache is
shared), then timed one after another in this process. Unchecked kernels and SDPA are timed
at the current and the best settings for reference.

    python benchmarks/tune_launch.py [--dims 64 128] [--length 4096] [--jobs 16] [--quick]

On a CPU (``--quick``) the kernels run in Triton's interpreter at L 64: a smoke run of the
code path (the interpreter ignores warps and stages; its times mean nothing).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import statistics
import time
import traceback

if __name__ == "__main__":
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import torch
from torch.nn import functional as F

from _common import environment, parse, write
from attnchecker.kernels import flash

KERNELS = ("fwd", "dkdv", "dq")
TILES = [(m, n) for m in (32, 64, 128) for n in (32, 64, 128) if m * n <= 8192]
STAGES = {"fwd": (1, 2, 3), "dkdv": (1, 2), "dq": (1, 2)}
WARPS = (4, 8)


def candidates(kernel: str) -> list[flash.Launch]:
    return [flash.Launch(m, n, w, s)
            for (m, n), w, s in itertools.product(TILES, WARPS, STAGES[kernel])]  # fmt: skip


def _arch() -> int:
    return flash.device_arch(torch.device("cuda")) if torch.cuda.is_available() else 90


def _key(kernel: str, d: int) -> tuple[str, int, int, str]:
    """The LAUNCH row the kernels read for fp16 / bf16 at head size d here."""
    return flash.launch_key(kernel, _arch(), max(16, 1 << (d - 1).bit_length()), "half")


class _Case:
    """Operands of one (d, L) shape and the calls that run a kernel under a launch."""

    def __init__(self, d: int, L: int, B: int, H: int, device: str, dtype: torch.dtype):
        g = torch.Generator().manual_seed(0)
        self.q, self.k, self.v, self.grad = (
            torch.randn(B, H, L, d, generator=g).to(device, dtype) for _ in range(4)
        )
        self.out, self.lse, _ = flash.flash_forward(self.q, self.k, self.v, causal=True)
        self.counts = flash.new_counts(self.q.device)

    def call(self, kernel: str, check: bool):
        counts = self.counts if check else None
        if kernel == "fwd":
            return lambda: flash.flash_forward(
                self.q, self.k, self.v, causal=True, check=check, counts=counts
            )
        return lambda: flash.flash_backward(
            self.q, self.k, self.v, self.out, self.lse, self.grad, causal=True, check=check,
            counts=counts,
        )  # fmt: skip

    def sdpa(self, kernel: str):
        q, k, v = (t.detach().requires_grad_() for t in (self.q, self.k, self.v))
        if kernel == "fwd":
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(self.grad)

        return fwd_bwd


def _with(key, launch: flash.Launch, fn):
    """``fn()`` with ``LAUNCH[key]`` set to ``launch`` (restored after)."""
    old = flash.LAUNCH[key]
    flash.LAUNCH[key] = launch
    try:
        return fn()
    finally:
        flash.LAUNCH[key] = old


def _timed(timer, key, launch: flash.Launch, fn) -> float:
    """ms of ``fn`` with ``LAUNCH[key]`` set to ``launch``."""
    return _with(key, launch, lambda: timer(fn))


def _compile_share(args: tuple) -> list[str]:
    """A worker: run every candidate of its share once (compiling it into the disk cache)."""
    share, L, B, H, device, quick = args
    if quick:
        flash.device_arch = lambda _device: 90
    cases: dict[int, _Case] = {}
    failed = []
    for kernel, d, launch in share:
        case = cases.get(d) or cases.setdefault(d, _Case(d, L, B, H, device, _dtype(device)))
        try:
            _with(_key(kernel, d), launch, case.call(kernel, True))
        except Exception as e:  # out of shared memory, registers, ...: reported in the table
            failed.append(f"{kernel} d{d} {launch}: {type(e).__name__}: {str(e)[:120]}")
    if device == "cuda":
        torch.cuda.synchronize()
    return failed


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _timer(device: str):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=30)

    def cpu(fn) -> float:
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    return cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    ap.add_argument("--jobs", type=int, default=16 if cuda else 2)
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds from the start: no candidate is timed after it")  # fmt: skip
    args = parse(ap, quick={"dims": [64], "length": 64, "kernels": ["fwd", "dq"]})
    device = "cuda" if cuda else "cpu"
    if args.quick:  # the interpreter: every candidate's blocks, none of its warps or stages
        flash.device_arch = lambda _device: 90
        global TILES, STAGES, WARPS
        TILES, STAGES, WARPS = [(32, 32), (64, 32)], {k: (1,) for k in KERNELS}, (4,)
    t_start = time.perf_counter()
    L = args.length
    B, H = (2, 16) if cuda else (1, 2)
    work = [(kn, d, c) for d in args.dims for kn in args.kernels for c in candidates(kn)]
    t0 = time.perf_counter()
    jobs = max(1, min(args.jobs, len(work)))
    shares = [(work[i::jobs], L, B, H, device, args.quick) for i in range(jobs)]
    with mp.get_context("spawn").Pool(jobs) as pool:
        failed = sorted({f for share in pool.map(_compile_share, shares) for f in share})
    compile_s = time.perf_counter() - t0
    print(f"compiled {len(work)} candidates in {compile_s:.0f} s; {len(failed)} failed",
          flush=True)  # fmt: skip
    timer = _timer(device)
    rows = []

    def late() -> bool:
        return bool(args.budget) and time.perf_counter() - t_start > args.budget

    for d in args.dims:
        case = _Case(d, L, B, H, device, _dtype(device))
        for kernel in args.kernels:
            key = _key(kernel, d)
            current = flash.LAUNCH[key]
            timed = []
            for launch in candidates(kernel):
                if late():
                    break
                case.counts.zero_()
                try:
                    ms = _timed(timer, key, launch, case.call(kernel, True))
                except Exception as e:
                    print(f"{kernel} d{d} {launch}: {type(e).__name__}", flush=True)
                    continue
                alarms = int(case.counts.sum())
                timed.append({"launch": launch, "ms": ms, "alarms": alarms})
            if not timed:
                continue
            clean = [t for t in timed if t["alarms"] == 0] or timed
            best = min(clean, key=lambda t: t["ms"])
            now = next((t for t in timed if t["launch"] == current), None)
            ref = {  # each a compilation of its own: only while there is time
                "unchecked_best_ms": None if late() else _timed(
                    timer, key, best["launch"], case.call(kernel, False)),
                "sdpa_ms": timer(case.sdpa(kernel)) if cuda else None,
            }  # fmt: skip
            row = {
                "kernel": kernel, "d": d, "L": L, "B": B, "H": H, "current": current.__dict__,
                "current_ms": None if now is None else now["ms"], "best": best["launch"].__dict__,
                "best_ms": best["ms"], **ref, "candidates": len(timed),
                "with_alarms": sum(t["alarms"] > 0 for t in timed),
                "top": [{**t["launch"].__dict__, "ms": t["ms"], "alarms": t["alarms"]}
                        for t in sorted(timed, key=lambda t: t["ms"])[:5]],
            }  # fmt: skip
            rows.append(row)
            print(f"{kernel:4s} d{d}: current {current} {row['current_ms']} ms, best "
                  f"{best['launch']} {best['ms']:.3f} ms; unchecked {ref['unchecked_best_ms']:.3f}"
                  f" ms; sdpa {ref['sdpa_ms']}", flush=True)  # fmt: skip
            _report(rows, failed, args, compile_s, device)  # each row: a run cut short keeps it


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _launch(launch: dict) -> str:
    return f"{launch['block_m']}x{launch['block_n']} w{launch['num_warps']} s{launch['num_stages']}"


def _report(rows: list[dict], failed: list[str], args, compile_s: float, device: str) -> None:
    env = environment()
    lines = [
        f"# Launch settings of the fused kernels ({device}, checked, causal, bf16)",
        "",
        f"`python benchmarks/tune_launch.py --dims {' '.join(map(str, args.dims))} --length "
        f"{args.length} --kernels {' '.join(args.kernels)}`; torch {env['torch']}, {env['date']};"
        f" compiled in {compile_s:.0f} s. dkdv / dq: the whole backward (the other kernel at "
        "its current setting). Launch: query tile x key tile, warps, stages.",
        "",
        "| kernel | d | current | ms | best | ms | gain | unchecked (best) ms | SDPA ms | candidates | with alarms |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gain = (
            "-" if r["current_ms"] is None else f"{100 * (1 - r['best_ms'] / r['current_ms']):.0f}%"
        )
        lines.append(
            f"| {r['kernel']} | {r['d']} | {_launch(r['current'])} | {_ms(r['current_ms'])} | "
            f"{_launch(r['best'])} | {_ms(r['best_ms'])} | {gain} | "
            f"{_ms(r['unchecked_best_ms'])} | {_ms(r['sdpa_ms'])} | {r['candidates']} | "
            f"{r['with_alarms']} |"
        )
    lines += ["", "Top five per kernel:", ""]
    for r in rows:
        top = ", ".join(f"{_launch(t)} {t['ms']:.3f}" for t in r["top"])
        lines.append(f"- {r['kernel']} d {r['d']}: {top}")
    if failed:
        lines += ["", f"Candidates that did not run ({len(failed)}):", ""]
        lines += [f"- {f}" for f in failed]
    median = statistics.median([r["best_ms"] for r in rows]) if rows else 0
    payload = {"env": env, "args": vars(args), "rows": rows, "failed": failed,
               "compile_s": compile_s, "median_best_ms": median}  # fmt: skip
    write("launch_tuning", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        traceback.print_exc()
        raise SystemExit(130) from None
