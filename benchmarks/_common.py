"""Shared by the benchmark scripts: the command line (``--quick``), environment record, result
files, timing.

Every script takes ``--quick``: its smallest size, a smoke run of seconds to a minute on 2 cores
that goes through every code path of the full run (``make bench QUICK=1`` runs them all). A quick
run's files are named ``<theme>_quick_<hardware>_<date>`` and go to :data:`QUICK_DIR`, outside
the repository, so they never overwrite (or get committed as) a full result.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
QUICK_DIR = Path(
    os.environ.get("BENCH_QUICK_DIR", Path(tempfile.gettempdir()) / "attnchecker-bench")
)
_QUICK = False  # set by parse(): whether this process is a --quick run


def parse(ap: argparse.ArgumentParser, quick: dict[str, object]) -> argparse.Namespace:
    """``ap.parse_args()`` plus ``--quick``: the script's smallest size, ``quick``'s values
    replacing the defaults of those options (an option given on the command line still wins).
    """
    global _QUICK
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smallest size (a smoke run; files go to $BENCH_QUICK_DIR or the temp dir, "
        "named <theme>_quick_..., never over a full result)",
    )
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(**quick)
        args = ap.parse_args()
    _QUICK = args.quick
    return args


def command() -> str:
    """The command line of this run, as ``python benchmarks/<script> ...``, after the check
    implementation's environment variable where it is set (it changes what runs; a script may
    set it itself)."""
    script = Path(sys.argv[0])
    impl = os.environ.get("ATTNCHECKER_CHECK_IMPL")
    env = [f"ATTNCHECKER_CHECK_IMPL={impl}"] if impl else []
    return shlex.join([*env, "python", f"benchmarks/{script.name}", *sys.argv[1:]])


def environment() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": _dt.date.today().isoformat(),
        # other processes on a shared machine: at a load above the core count, timings with 2
        # threads slow down many-fold (each op waits for its descheduled sibling thread)
        "loadavg_1min": os.getloadavg()[0],
    }


def hardware_tag() -> str:
    return f"cpu{os.cpu_count()}" if not torch.cuda.is_available() else "cuda"


def write(theme: str, payload: dict[str, object], markdown: str) -> Path:
    """Write ``<theme>_<hardware>_<date>.json`` and ``.md`` under results/ (a ``--quick`` run:
    ``<theme>_quick_<hardware>_<date>`` under :data:`QUICK_DIR`, its report marked as such).
    The JSON also records the command line and whether the run was quick."""
    out = QUICK_DIR if _QUICK else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if _QUICK else ""
    stem = out / f"{theme}{tag}_{hardware_tag()}_{_dt.date.today().isoformat()}"
    payload = {"command": command(), "quick": _QUICK, **payload}
    if _QUICK:
        markdown = f"> Quick run (`{command()}`): smoke size, not a result.\n\n{markdown}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem}.json / .md")
    return stem


def timed(fn: Callable[[], object]) -> float:
    """Seconds for one call (on CUDA, once its queued kernels have run)."""
    cuda = torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def alternate(
    fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3
) -> dict[str, list[float]]:
    """Time each function ``reps`` times, interleaved call by call so drift hits all equally."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            times[k].append(timed(f))
    return times


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def impl_tag(check_impl: str) -> str:
    """A result file's suffix for a run with ``ABFTConfig.check_impl`` (none for the default)."""
    return "" if check_impl == "auto" else f"_{check_impl}"


def impl_words(check_impl: str) -> str:
    """What a run with ``check_impl`` checks how, for a report's first lines."""
    if check_impl == "auto":
        return "the CPU default: the eager engine"
    if check_impl == "accumulator":
        return ("the eager core; the projections' GEMMs, forward and backward, by the "
                "accumulator GEMM in Triton's interpreter")
    return f"check_impl={check_impl!r}"
