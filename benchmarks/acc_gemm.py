"""The accumulator GEMM (``check_impl="accumulator"``): its bound's margin, what it sees, its time.

``attnchecker.kernels.acc_gemm`` computes a linear layer's GEMM and checks each row on the fp32
accumulator (``attnchecker.abft.tolerance.accumulator_terms``). Its probabilistic term assumes
what the matrix units do as they accumulate, so the margin is measured on the device; its speed
against cuBLAS can only be measured on a GPU (on a CPU the kernel runs in Triton's interpreter:
the times there mean nothing and are not written). Per shape (T tokens, K inner, N outputs) of
base width and of Llama-8B's layers, dtype, data normal / outlier features (three input
features 100x) / positive, clean products:

- **margin**: the largest |residual| / tolerance over every row (1 would be a false alarm);
- **alarms**: rows flagged (must be 0);
- **threshold**: the smallest r on a grid of eighth-decades from 1e-7 from which an error of r x
  its row's L1 norm in one accumulator element (the kernel's fault emulation) is flagged in
  every row (normal data);
- on CUDA, **ms** of the checked GEMM (its two launches, W's references at hand as they are
  once per step) and of ``torch.mm`` (cuBLAS), medians of 20 alternated pairs after warm-up,
  CUDA events; **x cuBLAS** their ratio.

    python benchmarks/acc_gemm.py [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

if not torch.cuda.is_available():  # the kernels run in Triton's interpreter (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _common import environment, parse, write
from attnchecker.kernels import acc_gemm as ag
from attnchecker.kernels.gemm_check import gemm_refs
from gemm_bounds import _operands  # the same operands as the delivered bound's stage

SHAPES = {  # (T, K, N): a projection's y, its dX (K = N_out), its dW (K = T)
    "base qkv y": (4096, 768, 2304),
    "base dX": (4096, 2304, 768),
    "base dW": (2304, 4096, 768),
    "8B q y": (4096, 4096, 4096),
    "8B up y": (4096, 4096, 14336),
    "8B down y": (4096, 14336, 4096),
}
CPU = {"base qkv y (256 rows)": (256, 768, 2304), "base dX (256 rows)": (256, 2304, 768)}
TINY = {"tiny y": (64, 96, 80), "tiny dX": (64, 80, 96)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRID = [10.0 ** (e / 8) for e in range(-56, 1)]  # 1e-7 .. 1


def _check(x, y, refs, delta=None) -> tuple[int, torch.Tensor]:
    """(rows flagged, each row's |residual| / tolerance) as the kernel computed them on the
    device's own accumulation (its scratch: residual, excess), before any repair."""
    rec = torch.zeros(7, dtype=torch.float64, device=x.device)
    step = torch.zeros(1, dtype=torch.float64, device=x.device)
    _out, scr, _bits = ag.acc_mm(x, y, None, refs, delta, rec, step, *ag.terms(x, y))
    res, exc = scr[1].abs(), scr[2]
    return int(rec[0]), res / (res - exc)


def _flagged(x, y, refs, delta=None) -> int:
    return _check(x, y, refs, delta)[0]


def _threshold(x, y, refs, g):
    """The smallest r of :data:`GRID` at which every row is flagged (a bisection over the grid:
    flagging grows with r)."""
    M, N = x.shape[0], y.shape[1]
    rows = torch.arange(M, device=x.device)
    cols = torch.randint(0, N, (M,), generator=g, device=x.device)
    l1 = (x.float() @ y.float()).abs().sum(1)

    def every(r: float) -> bool:
        delta = torch.zeros(M, N, device=x.device)
        delta[rows, cols] = r * l1
        return _flagged(x, y, refs, delta) == M

    lo, hi = 0, len(GRID) - 1
    if not every(GRID[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if every(GRID[mid]):
            hi = mid
        else:
            lo = mid + 1
    return GRID[lo]


def _times(x, y, refs, pairs=20) -> tuple[float, float]:
    """(checked ms, torch.mm ms): medians of alternated pairs, CUDA events."""
    rec = torch.zeros(7, dtype=torch.float64, device=x.device)
    step = torch.zeros(1, dtype=torch.float64, device=x.device)
    arms = {"checked": lambda: ag.checked_mm(x, y, None, rec, step, refs=refs),
            "cublas": lambda: torch.mm(x, y)}  # fmt: skip
    for fn in arms.values():  # warm-up (compiles the kernel once)
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(pairs):
        for name, fn in arms.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b))
    return statistics.median(times["checked"]), statistics.median(times["cublas"])


def run(device: str, shapes: dict) -> list[dict]:
    rows = []
    for name, (T, K, N) in shapes.items():
        for dname, dtype in DTYPES.items():
            g = torch.Generator(device=device).manual_seed(0)
            row = {"shape": name, "T": T, "K": K, "N": N, "dtype": dname, "margin": 0.0,
                   "alarms": 0}  # fmt: skip
            for data in ("normal", "outlier", "positive"):
                x, y = _operands(T, K, N, dtype, data, device, g)
                refs = gemm_refs(y)
                flagged, ratio = _check(x, y, refs)
                row["margin"] = max(row["margin"], float(ratio.max()))
                row["alarms"] += flagged
                if data == "normal":
                    row["threshold"] = _threshold(x, y, refs, g)
                    if device == "cuda":
                        row["ms"], row["cublas_ms"] = _times(x, y, refs)
            print(row, flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = parse(ap, quick={"tiny": True})
    t0 = time.perf_counter()
    shapes = TINY if args.tiny else SHAPES if args.device == "cuda" else CPU
    rows = run(args.device, shapes)
    env = environment()
    timed = args.device == "cuda"
    lines = [
        "# The accumulator GEMM: its bound's margin, the smallest error it sees, its time",
        "",
        f"`python benchmarks/acc_gemm.py --device {args.device}"
        f"{' --tiny' if args.tiny else ''}`; {env['date']}, {args.device}"
        f"{'' if timed else ' (Triton interpreter: no times)'}, "
        f"{time.perf_counter() - t0:.0f} s. Margin: the largest |residual| / tolerance of a "
        "clean row (below 1: no alarm); threshold: one accumulator element moved by r x its "
        "row's L1 norm, every row flagged from r (normal data).",
        "",
        "| shape | T, K, N | dtype | margin | alarms | threshold |"
        + (" ms | cuBLAS ms | x cuBLAS |" if timed else ""),
        "|---|---|---|---:|---:|---:|" + ("---:|---:|---:|" if timed else ""),
    ]
    for r in rows:
        th = "-" if r["threshold"] is None else f"{r['threshold']:.3g}"
        line = (f"| {r['shape']} | {r['T']}, {r['K']}, {r['N']} | {r['dtype']} | "
                f"{r['margin']:.3g} | {r['alarms']} | {th} |")  # fmt: skip
        if timed:
            line += f" {r['ms']:.3f} | {r['cublas_ms']:.3f} | {r['ms'] / r['cublas_ms']:.2f} |"
        lines.append(line)
    write("acc_gemm", {"environment": env, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
