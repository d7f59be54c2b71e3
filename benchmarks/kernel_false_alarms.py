"""False alarms of the fused kernels' checks on clean data, per check, dtype and TF32 setting.

The kernels' tolerances are derived (``attnchecker.abft.tolerance.kernel_factor``), not
calibrated: this sweep is the calibration. Every clean forward + backward of
``flash_attention`` over dtypes (bf16: the native bf16 path on a GPU; fp16; fp32 with TF32
off and on), head sizes, lengths, input scales (0.1 .. 30: logits up to ~1e3), causal on and
off, must leave every counter at 0. On a GPU: real MMAs (what the tolerances must hold for);
on CPU the interpreter (numpy fp32 products, no TF32: only a smoke test, ``--quick``).

    python benchmarks/kernel_false_alarms.py [--lengths 1024 4096] [--dims 64 128] [--quick]
"""

from __future__ import annotations

import argparse
import os

if __name__ == "__main__":
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are decorated

import torch

from _common import command, environment, parse, write
from attnchecker.kernels import CHECKS
from attnchecker.kernels.flash import new_counts
from attnchecker.kernels.ops import flash_attention, new_sink

ARMS = {"bf16": (torch.bfloat16, False), "fp16": (torch.float16, False),
        "fp32": (torch.float32, False), "fp32+tf32": (torch.float32, True)}  # fmt: skip


def _run(arm, L, d, scale, causal, device, seed):
    dtype, tf32 = ARMS[arm]
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv = 2, 4, 2
    q = (scale * torch.randn(B, H, L, d, generator=g)).to(device, dtype).requires_grad_()
    k, v = ((scale * torch.randn(B, Hkv, L, d, generator=g)).to(device, dtype).requires_grad_()
            for _ in range(2))  # fmt: skip
    counts, sink = new_counts(q.device), new_sink(q.device)
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = tf32
        out = flash_attention(q, k, v, causal=causal, counts=counts, sink=sink)
        out.float().square().sum().backward()
    finally:
        matmul.allow_tf32 = before
    total = counts + sink.grad.to(torch.int32)
    return {c: int(total[i, 0]) for i, c in enumerate(CHECKS)}


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096] if cuda else [96])
    ap.add_argument("--dims", nargs="+", type=int, default=[64, 128] if cuda else [64])
    ap.add_argument("--scales", nargs="+", type=float, default=[0.1, 1.0, 5.0, 30.0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--seeds", type=int, default=2)
    args = parse(ap, quick={"lengths": [80], "dims": [64], "scales": [1.0, 30.0], "seeds": 1,
                            "arms": ["bf16", "fp32"]})  # fmt: skip
    device = "cuda" if cuda else "cpu"
    rows = []
    for arm in args.arms:
        for d in args.dims:
            for L in args.lengths:
                for scale in args.scales:
                    for causal in (True, False):
                        alarms = {c: 0 for c in CHECKS}
                        for seed in range(args.seeds):
                            for c, n in _run(arm, L, d, scale, causal, device, seed).items():
                                alarms[c] += n
                        row = dict(arm=arm, d=d, L=L, scale=scale, causal=causal,
                                   runs=args.seeds, alarms=alarms,
                                   total=sum(alarms.values()))  # fmt: skip
                        rows.append(row)
                        print(f"{arm:10s} d {d:3d} L {L:5d} scale {scale:5.1f} "
                              f"causal {causal!s:5s}: {row['total']} alarms "
                              f"{ {c: n for c, n in alarms.items() if n} }", flush=True)  # fmt: skip
    total = sum(r["total"] for r in rows)
    lines = [
        "# Fused kernels: false alarms on clean data", "",
        f"`{command()}` on {device}; each row {args.seeds} seed(s) of a "
        "forward + backward (B 2, H 4, Hkv 2); an alarm is a detection by any kernel check.", "",
        f"**{total} alarms in {len(rows) * args.seeds} clean forward + backward runs.**", "",
        "| arm | d | L | scale | causal | alarms | by check |", "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        by = ", ".join(f"{c} {n}" for c, n in r["alarms"].items() if n) or "-"
        lines.append(f"| {r['arm']} | {r['d']} | {r['L']} | {r['scale']} | {r['causal']} | "
                     f"{r['total']} | {by} |")  # fmt: skip
    path = write("kernel_false_alarms", {"env": environment(), "rows": rows, "total": total},
                 "\n".join(lines) + "\n")  # fmt: skip
    print(f"{total} alarms; wrote {path}")
    raise SystemExit(1 if total else 0)


if __name__ == "__main__":
    main()
