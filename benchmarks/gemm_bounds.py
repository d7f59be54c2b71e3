"""How close clean GEMMs come to the rounding-tight bound, and the smallest error it sees.

The GEMM checks' bound (``attnchecker.abft.tolerance.gemm_terms``, issue 55) charges the
outputs' rounding to the delivered row's L1 norm and the accumulation to a probabilistic
sqrt(k) term. Its probabilistic part assumes what the GEMM's accumulation does (independent,
mean-zero rounding errors), so it is measured where it must hold: on the device's own GEMMs
(cuBLAS on a GPU; oneDNN / MKL on a CPU), at the shapes of base width and of Llama-8B's layers,
for the checks' rows as the registered ops compute them (``kernels.gemm_check.reference``: the
verify kernel's excesses, held equal by the tests).

Per shape (T tokens, K inner, N outputs), dtype and setting (bf16 with cuBLAS's reduced-precision
split-K reductions off, the setting the tight bound needs, and on), data normal / outlier
features (three input features 100x) / positive, clean products:

- **margin**: the largest |residual| / tolerance over every row (must stay below 1: a row at 1
  is a false alarm; the gap is the safety the model leaves);
- **alarms**: rows flagged;
- **threshold**: the smallest r on a quarter-decade grid from which one element moved by r x
  its row's L1 norm is flagged in every row (normal data).

    python benchmarks/gemm_bounds.py [--device cuda] [--tiny]
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import environment, parse, write
from attnchecker.abft.gemm import limits
from attnchecker.kernels import gemm_check as gc

SHAPES = {  # (T, K, N): a projection's y, its dX (K = N_out), its dW (K = T)
    "base qkv y": (4096, 768, 2304),
    "base dX": (4096, 2304, 768),
    "base dW": (2304, 4096, 768),
    "8B q y": (4096, 4096, 4096),
    "8B up y": (4096, 4096, 14336),
    "8B down y": (4096, 14336, 4096),
    "8B dW": (4096, 4096, 4096),
}
TINY = {"tiny y": (64, 96, 80), "tiny dX": (64, 80, 96)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GRID = [10.0 ** (e / 4) for e in range(-16, 1)]  # 1e-4 .. 1


def _operands(T, K, N, dtype, data, device, g):
    x = torch.randn(T, K, generator=g, device=device)
    if data == "positive":
        x = x.abs()
    elif data == "outlier":
        x[:, :3] = 100 * (x[:, :3].abs() + 1)
    y = torch.randn(K, N, generator=g, device=device) * K**-0.5
    return x.to(dtype), y.to(dtype)


def _excess(out, x, y):
    floor, a, c, cap, *_ = limits(out, x, y, 1.0)
    r = gc.reference(out, x, y, floor=floor, a=a, c=c, cap=cap)
    tol = r["res"].abs() - r["exc"]  # the tolerance each row had
    return r["exc"], r["res"].abs() / tol


def _threshold(out, x, y, g):
    M, N = out.shape
    rows = torch.arange(M, device=out.device)
    cols = torch.randint(0, N, (M,), generator=g, device=out.device)
    l1 = out.float().abs().sum(1)
    for r in GRID:
        bad = out.clone()
        bad[rows, cols] = (bad[rows, cols].float() + r * l1).to(out.dtype)
        if bool((~(_excess(bad, x, y)[0] <= 0)).all()):
            return r
    return None


def run(device: str, shapes: dict, reduced: bool) -> list[dict]:
    m = torch.backends.cuda.matmul
    was = m.allow_bf16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = reduced
    rows = []
    try:
        for name, (T, K, N) in shapes.items():
            for dname, dtype in DTYPES.items():
                if reduced and dtype != torch.bfloat16:
                    continue
                g = torch.Generator(device=device).manual_seed(0)
                row = {"shape": name, "T": T, "K": K, "N": N, "dtype": dname,
                       "bf16_reduced": reduced, "margin": 0.0, "alarms": 0}  # fmt: skip
                for data in ("normal", "outlier", "positive"):
                    x, y = _operands(T, K, N, dtype, data, device, g)
                    out = x @ y
                    exc, ratio = _excess(out, x, y)
                    row["margin"] = max(row["margin"], float(ratio.max()))
                    row["alarms"] += int((~(exc <= 0)).sum())
                    if data == "normal":
                        row["threshold"] = _threshold(out, x, y, g)
                print(row, flush=True)
                rows.append(row)
    finally:
        m.allow_bf16_reduced_precision_reduction = was
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = parse(ap, quick={"tiny": True})
    t0 = time.perf_counter()
    shapes = TINY if args.tiny else SHAPES
    rows = run(args.device, shapes, reduced=False)
    if args.device == "cuda":
        rows += run(args.device, shapes, reduced=True)
    env = environment()
    lines = [
        "# The GEMM checks' rounding-tight bound on the device's own GEMMs",
        "",
        f"`python benchmarks/gemm_bounds.py --device {args.device}"
        f"{' --tiny' if args.tiny else ''}`; {env['date']}, {args.device}, "
        f"{time.perf_counter() - t0:.0f} s. Margin: the largest |residual| / tolerance of a "
        "clean row (below 1: no alarm); threshold: one element moved by r x its row's L1 norm, "
        "every row flagged from r (normal data).",
        "",
        "| shape | T, K, N | dtype | bf16 split-K in bf16 | margin | alarms | threshold |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        th = "-" if r["threshold"] is None else f"{r['threshold']:.3g}"
        lines.append(f"| {r['shape']} | {r['T']}, {r['K']}, {r['N']} | {r['dtype']} | "
                     f"{r['bf16_reduced']} | {r['margin']:.3g} | {r['alarms']} | {th} |")  # fmt: skip
    write("gemm_bounds", {"environment": env, "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
