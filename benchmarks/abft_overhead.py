"""Encode + verify overhead of checksum-protected GEMMs against the plain GEMM, on this machine.

Shapes: attention at BERT-base size (B 8, nh 12, L 128, d 64): scores Q K^T and context P V;
and one 1024^3 GEMM. For each, the plain ``a @ b`` and ``protected_matmul(a, b)`` are called
alternately in one process; the overhead is the median over repetitions of the per-pair ratio.
The breakdown times each stage alone: encode (reference checksums and magnitudes from the
operands), multiply, recompute (checksums of C) and locate+correct (the fixed-size candidate
work, including the rebuild of one row and one column from the operands).

    python benchmarks/abft_overhead.py [--reps 50] [--quick]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from _common import alternate, environment, median_ms, parse, write
from attnchecker.abft import correct_, encode, protected_matmul, recompute


def _cases(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    B, nh, L, d = 8, 12, 128, 64
    q, k, v = (torch.randn(B, nh, L, d, generator=gen) for _ in range(3))
    p = (q @ k.mT / d**0.5).softmax(-1)
    x, w = torch.randn(1024, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    return {
        "scores QK^T (8,12,128,64)": (q, k.mT),
        "context PV (8,12,128,128)@(..,128,64)": (p, v),
        "GEMM 1024^3": (x, w),
    }


VARIANTS = {
    # name: (check, lines, use the nonnegativity of probabilities as |P| = P)
    "both+lines": ("both", True, False),
    "both, 0D only": ("both", False, False),
    "rows, 0D only": ("rows", False, False),
    "both+lines, |P| hint": ("both", True, True),
}


def run(reps: int, variant: str, warmup: int = 3) -> list[dict[str, object]]:
    check, lines, hint = VARIANTS[variant]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (a, b) in _cases(gen).items():
        a_abs = a if hint and name.startswith("context") else None
        if hint and a_abs is None:
            continue
        sums = encode(a, b, check=check, a_abs=a_abs)
        c = a @ b
        t = alternate(
            {
                "plain": lambda: a @ b,  # noqa: B023
                "protected": lambda: protected_matmul(a, b, check=check, lines=lines, a_abs=a_abs),  # noqa: B023
                "encode": lambda: encode(a, b, check=check, a_abs=a_abs),  # noqa: B023
                "recompute": lambda: recompute(c, check=check),  # noqa: B023
                "verify+correct": lambda: correct_(c, sums, a, b, lines=lines),  # noqa: B023
            },
            reps,
            warmup,
        )
        ratio = statistics.median(p / q for p, q in zip(t["protected"], t["plain"], strict=True))
        plain = median_ms(t["plain"])
        row = {
            "case": name,
            "variant": variant,
            "plain_ms": plain,
            "protected_ms": median_ms(t["protected"]),
            "overhead": ratio - 1,
            "encode_ms": median_ms(t["encode"]),
            "recompute_ms": median_ms(t["recompute"]),
            "locate_correct_ms": median_ms(t["verify+correct"]) - median_ms(t["recompute"]),
        }
        rows.append(row)
        print(
            f"{name:38s} {variant:21s} plain {plain:7.3f} ms  protected {row['protected_ms']:7.3f} ms  "
            f"overhead {100 * row['overhead']:6.1f}%  | encode {row['encode_ms']:.3f}  "
            f"recompute {row['recompute_ms']:.3f}  locate+correct {row['locate_correct_ms']:.3f} ms"
        )
    return rows


def _markdown(rows: list[dict[str, object]], env: dict[str, object], reps: int) -> str:
    lines = [
        "# ABFT math core: encode + verify overhead",
        "",
        f"`python benchmarks/abft_overhead.py --reps {reps}`; torch {env['torch']}, "
        f"{env['threads']} threads, {env['processor']}, {env['date']}. fp32. Median of {reps} "
        "alternated repetitions; overhead = median of per-pair (protected / plain) - 1.",
        "",
        "| case | variant | plain ms | protected ms | overhead | encode ms | recompute ms | locate+correct ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['variant']} | {r['plain_ms']:.3f} | {r['protected_ms']:.3f} | "
            f"{100 * r['overhead']:.1f}% | {r['encode_ms']:.3f} | {r['recompute_ms']:.3f} | "
            f"{r['locate_correct_ms']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50, help="alternated repetitions per case")
    ap.add_argument("--warmup", type=int, default=3)
    args = parse(ap, quick={"reps": 3, "warmup": 1})
    env = environment()
    rows = [r for v in VARIANTS for r in run(args.reps, v, args.warmup)]
    write(
        "abft_overhead",
        {"environment": env, "args": vars(args), "reps": args.reps, "rows": rows},
        _markdown(rows, env, args.reps),
    )


if __name__ == "__main__":
    main()
