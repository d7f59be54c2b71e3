"""Shared by the benchmark scripts: environment record, result files, timing."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def environment() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "date": _dt.date.today().isoformat(),
    }


def hardware_tag() -> str:
    return f"cpu{os.cpu_count()}" if not torch.cuda.is_available() else "cuda"


def write(theme: str, payload: dict[str, object], markdown: str) -> Path:
    """Write ``<theme>_<hardware>_<date>.json`` and ``.md`` under results/."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"{theme}_{hardware_tag()}_{_dt.date.today().isoformat()}"
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem}.json / .md")
    return stem


def timed(fn: Callable[[], object]) -> float:
    """Seconds for one call (CPU: no asynchronous queue to drain)."""
    t0 = time.perf_counter()
    fn()
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
