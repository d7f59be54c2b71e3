"""The cost of one checked GEMM: the backward's check of a linear layer's dX = dY W and
dW = dY^T X (``attention.kernel_checks.gemm_check``, rows and columns, repair included) against the
GEMM it checks, eager and as the ``torch.compile``d region that ``check_impl="compiled"`` runs
(inductor: C++ on a CPU), with its aten op count (eager) and the kernels its region calls, and
on CUDA as the registered Triton ops that ``check_impl="triton"`` (``"auto"`` on CUDA) runs
(``attnchecker.kernels.gemm_check``: references, rows verified, repair waiting for a flag).

The shapes are the fused Q|K|V projection of a base-width layer (T = 8 x 128 tokens, K 768,
N 2,304) in GPT-2's Conv1D layout (dX multiplies the transposed weight) and in nn.Linear's (dW
multiplies dY^T); arms alternated call by call in one process, medians.

    python benchmarks/gemm_check.py [--reps 30] [--dtypes fp32 bf16] [--no-compile] [--quick]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import alternate, environment, median_ms, parse, write
from attnchecker.attention.checks import record
from attnchecker.attention.impl import resolve
from attnchecker.attention.kernel_checks import gemm_check
from attnchecker.kernels import available as kernels_available
from attnchecker.testing import count_ops, inductor_kernels

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cases(T: int, K: int, N: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    dy = torch.randn(T, N, generator=g).to(device, dtype)
    x = torch.randn(T, K, generator=g).to(device, dtype)
    w = (torch.randn(K, N, generator=g) / K**0.5).to(device, dtype)  # Conv1D's (K, N)
    return {  # name: (x, y) of out = x @ y
        "dX = dY W^T (Conv1D)": (dy, w.t()),
        "dW = dY^T X (Linear)": (dy.t(), x),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled arm")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (adds the Triton kernels' arm)")
    ap.add_argument(
        "--profile", action="store_true",
        help="also each arm under torch.profiler: kernels per call, their device time per call "
        "(against the wall time: launch-bound where it is far below) and the top kernels",
    )  # fmt: skip
    args = parse(ap, quick={"reps": 3, "tokens": 128, "dtypes": ["fp32"]})
    K, N = (768, 2304) if not args.quick else (96, 288)
    rows = []
    for dname in args.dtypes:
        for case, (x, y) in _cases(args.tokens, K, N, DTYPES[dname], args.device).items():
            out = x @ y

            def check(out=out, x=x, y=y, impl="eager"):
                # "triton": the GEMM check's registered ops (refs, verify, repair), as the
                # linear layers' backward runs them; else its region, eager or compiled
                how = resolve(impl, out.device)
                record(*gemm_check(how, out, x, y, max_rows=8, scale=1.0))

            arms = {"gemm": lambda x=x, y=y: x @ y, "eager": check}
            row = {"case": case, "dtype": dname, "ops": count_ops(check).launching}
            if not args.no_compile:  # the region as check_impl="compiled" runs it
                t0 = time.perf_counter()
                with inductor_kernels() as kernels:
                    check(impl="compiled")
                row["compile_s"] = time.perf_counter() - t0
                row["kernels"] = kernels.total
                arms["compiled"] = lambda c=check: c(impl="compiled")
            if args.device == "cuda" and kernels_available():
                arms["triton"] = lambda c=check: c(impl="triton")
            times = alternate(arms, args.reps)
            row |= {f"{k}_ms": median_ms(v) for k, v in times.items()}
            if args.profile:
                try:
                    row["profile"] = {k: _profile(f, args.device) for k, f in arms.items()}
                except Exception as e:  # the profiler's event API differs between versions
                    print(f"profile failed: {type(e).__name__}: {e}")
            rows.append(row)
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
    lines = [
        "# One checked GEMM: the check against the GEMM it checks",
        "",
        f"`{' '.join(['python benchmarks/gemm_check.py', f'--reps {args.reps}'])}`; "
        f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads. "
        f"T {args.tokens}, "
        f"K {K}, N {N}; medians of alternated calls; the check includes its fixed-size repair.",
        "",
        "| GEMM | dtype | GEMM ms | check eager ms (share) | check compiled ms (share) "
        "| check triton ms (share) | launching ops (eager) | kernels (compiled) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def share(r: dict, arm: str) -> str:
        ms = r.get(f"{arm}_ms")
        return "-" if ms is None else f"{ms:.2f} ({ms / r['gemm_ms']:.0%})"

    for r in rows:
        lines.append(
            f"| {r['case']} | {r['dtype']} | {r['gemm_ms']:.2f} | {share(r, 'eager')} | "
            f"{share(r, 'compiled')} | {share(r, 'triton')} | {r['ops']} | "
            f"{r.get('kernels', '-')} |"
        )
    for r in rows:
        for arm, p in r.get("profile", {}).items():
            top = ", ".join(f"{name[:60]} {ms:.3f}" for name, ms in p["top"])
            lines.append(
                f"\n- profile {r['case']} {r['dtype']} {arm}: {p['kernels']:.0f} kernels, "
                f"{p['device_ms']:.3f} ms on the device per call (wall {r[f'{arm}_ms']:.3f} ms); "
                f"top: {top}"
            )
    write("gemm_check", {"env": environment(), "rows": rows}, "\n".join(lines) + "\n")


def _profile(fn, device: str, calls: int = 10) -> dict[str, object]:
    """Kernels (device ops) per call of ``fn``, their time per call in ms, the top five."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:  # device-side events: the kernels themselves
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        per = {}
        for e in kernels:
            per[e.name] = per.get(e.name, 0.0) + e.device_time_total / 1e3 / calls
    else:  # aten ops' own CPU time
        kernels = [e for e in prof.events() if e.name.startswith("aten::")]
        per = {}
        for e in kernels:
            per[e.name] = per.get(e.name, 0.0) + e.self_cpu_time_total / 1e3 / calls
    top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
    return {"kernels": len(kernels) / calls, "device_ms": sum(per.values()), "top": top}


if __name__ == "__main__":
    main()
