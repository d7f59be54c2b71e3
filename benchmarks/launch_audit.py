"""Every Triton launch of one protected training step at Llama-8B widths, recorded on this CPU
without running anything (:func:`attnchecker.gpu_cost.launch_audit`): grid, programs, bytes of
arguments and bytes a program, and the launches that break issue 54's rules (more than 2 MB a
program; fewer programs than an H100's 132 SMs over more than 32 MB). Counts and sizes, not
times.

    python benchmarks/launch_audit.py [--length 4096] [--bf16-weights]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from attnchecker import ABFTConfig
from attnchecker.gpu_cost import audit_failures, launch_audit

ARMS = {
    "default": ABFTConfig(backend="sdpa", check_impl="triton"),
    "all_linear": ABFTConfig(backend="sdpa", check_impl="triton", scope="all_linear"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--bf16-weights", action="store_true")
    p.add_argument("--arms", nargs="*", default=list(ARMS))
    a = p.parse_args()
    for arm in a.arms:
        launches = launch_audit(ARMS[arm], L=a.length, autocast=not a.bf16_weights)
        print(f"\n## {arm}: {len(launches)} launches")
        for n in launches:
            print(
                f"{n.kernel:24s} grid={n.grid!s:16s} programs={n.programs:6d} "
                f"MB={n.bytes / 1e6:8.1f} MB/program={n.per_program / 1e6:7.3f}"
            )
        bad = audit_failures(launches)
        print(f"{len(bad)} of {len(launches)} break the rules" + "".join(f"\n  {b}" for b in bad))


if __name__ == "__main__":
    main()
