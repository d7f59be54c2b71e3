"""The checked flash kernels against the unchecked kernels and SDPA: time, and false alarms.

On CUDA (``triton.testing.do_bench``, bf16, B * L = 16k tokens, H 16): forward and forward +
backward of the checked kernels, the same kernels with their checks compiled out
(``check=False``) and PyTorch's SDPA (its flash backend), for L in {1k, 4k, 16k}, d in {64, 128},
causal on and off; every checked run's counters must stay 0 (the false-alarm count on real
MMAs, which calibrates the tolerances). On CPU the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``): small shapes only, median of repeated runs, to show what the tests
cost and the checks' share of the interpreter's time (not a GPU estimate).

The checked arm is what ``ABFTConfig(backend="triton")`` runs inside attention (the kernels'
checks; tolerances their own), called directly here.

    python benchmarks/flash_kernels.py [--lengths 1024 4096 16384] [--dims 64 128] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

if __name__ == "__main__":
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import torch
from torch.nn import functional as F

from _common import environment, parse, write
from attnchecker.kernels.flash import new_counts
from attnchecker.kernels.ops import flash_attention, new_sink


def _operands(B, H, L, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, d, generator=g).to(device, dtype).requires_grad_() for _ in "qkv"]


def _timer(device: str, reps: int):
    if device == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=max(50, reps * 10))

    def cpu(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    return cpu


def _arms(q, k, v, causal, counts, sink):
    grad = torch.randn_like(q)

    def fused(check: bool, backward: bool):
        def run():
            out = flash_attention(
                q, k, v, causal=causal, check=check, counts=counts if check else None,
                sink=sink if check else None,
            )  # fmt: skip
            if backward:
                out.backward(grad)

        return run

    def sdpa(backward: bool):
        def run():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.backward(grad)

        return run

    arms = {}
    for phase, backward in (("fwd", False), ("fwd+bwd", True)):
        arms[("checked", phase)] = fused(True, backward)
        arms[("unchecked", phase)] = fused(False, backward)
        if q.device.type == "cuda":
            arms[("sdpa", phase)] = sdpa(backward)
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    ap.add_argument(
        "--lengths", nargs="+", type=int, default=[1024, 4096, 16384] if cuda else [128]
    )
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128] if cuda else [64])
    ap.add_argument("--reps", type=int, default=10 if cuda else 3)
    ap.add_argument("--tag", default="")
    args = parse(ap, quick={"lengths": [1024] if cuda else [64], "dims": [64], "reps": 1})
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = _timer(device, args.reps)
    rows = []
    for L in args.lengths:
        for d in args.dims:
            for causal in (True, False):
                B, H = (max(1, 16384 // L), 16) if cuda else (1, 2)
                q, k, v = _operands(B, H, L, d, dtype, device)
                counts, sink = new_counts(q.device), new_sink(q.device)
                ms = {}
                for (arm, phase), fn in _arms(q, k, v, causal, counts, sink).items():
                    ms[f"{arm} {phase}"] = timer(fn)
                false_alarms = int(counts.sum()) + (
                    0 if sink.grad is None else int(sink.grad.sum())
                )
                row = {"L": L, "d": d, "causal": causal, "B": B, "H": H, "ms": ms,
                       "false_alarms": false_alarms}  # fmt: skip
                for phase in ("fwd", "fwd+bwd"):
                    c, u = ms[f"checked {phase}"], ms[f"unchecked {phase}"]
                    row[f"checked_vs_unchecked {phase}"] = c / u - 1
                    if f"sdpa {phase}" in ms:
                        row[f"checked_vs_sdpa {phase}"] = c / ms[f"sdpa {phase}"] - 1
                rows.append(row)
                print(L, d, causal, {k: f"{v:.2f} ms" for k, v in ms.items()},
                      "false alarms", false_alarms, flush=True)  # fmt: skip
    env = environment()
    head = "| L | d | causal | B x H | phase | checked ms | unchecked ms | sdpa ms | checked vs unchecked | checked vs sdpa | false alarms |"
    lines = [
        f"# Checked flash kernels ({'CUDA, bf16, do_bench' if cuda else 'Triton interpreter on CPU, fp32, median'})",
        "",
        f"`python benchmarks/flash_kernels.py --lengths {' '.join(map(str, args.lengths))} --dims "
        f"{' '.join(map(str, args.dims))} --reps {args.reps}`; torch {env['torch']}, {env['date']}. "
        'Checked: the kernels as `ABFTConfig(backend="triton")` runs them.',
        "",
        head,
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for phase in ("fwd", "fwd+bwd"):
            sd = r["ms"].get(f"sdpa {phase}")
            vs = r.get(f"checked_vs_sdpa {phase}")
            lines.append(
                f"| {r['L']} | {r['d']} | {r['causal']} | {r['B']} x {r['H']} | {phase} | "
                f"{r['ms'][f'checked {phase}']:.2f} | {r['ms'][f'unchecked {phase}']:.2f} | "
                f"{'-' if sd is None else f'{sd:.2f}'} | "
                f"{100 * r[f'checked_vs_unchecked {phase}']:+.1f}% | "
                f"{'-' if vs is None else f'{100 * vs:+.1f}%'} | {r['false_alarms']} |"
            )
    theme = "flash_kernels" + (f"_{args.tag}" if args.tag else "")
    write(theme, {"env": environment(), "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
