"""The curated mutation run (``tests/mutation/mutants.py``): each one-line change applied to a
copy of ``src/`` and its tests run there; a change no test catches is a survivor.

    python scripts/mutation.py [--jobs 2] [--only PATTERN] [--ids N ...] [--out FILE]

Run by ``make test-all``. Each job has its own copy of the source tree (the package is found on
PYTHONPATH before the editable install), so the working tree is never touched. A change is
killed when its tests fail (pytest exit 1); an error of another kind (a collection error, a
timeout) is reported as such, not as killed. Exit 0 when every survivor is one the list argues
equivalent, 1 otherwise; the table (markdown) goes to stdout and to ``--out``."""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.mutation.mutants import MUTANTS, TESTS, Mutant  # noqa: E402


def _run(m: Mutant, src: Path, timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, the last line of pytest's output) of ``m`` applied under ``src``."""
    path = src / "attnchecker" / m.path
    original = path.read_text()
    assert original.count(m.old) == 1, f"{m.path}: {m.old!r} does not occur exactly once"
    path.write_text(original.replace(m.old, m.new))
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0",
           "-o", "addopts=-m 'not slow'", *(m.tests or TESTS[m.path])]  # fmt: skip
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=timeout)  # fmt: skip
        outcome = {0: "SURVIVED", 1: "killed"}.get(r.returncode, f"error (rc {r.returncode})")
        tail = (r.stdout.strip().splitlines() or [""])[-1]
    except subprocess.TimeoutExpired:
        outcome, tail = "error (timeout)", ""
    finally:
        path.write_text(original)
    return outcome, time.perf_counter() - t0, tail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="run the mutants whose path or text holds this")
    ap.add_argument("--ids", type=int, nargs="+", help="run these mutants (the table's #)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mutant")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    todo = [(i, m) for i, m in enumerate(MUTANTS)
            if (args.ids is None or i in args.ids)
            and (args.only in m.path or args.only in m.old or args.only in m.new)]  # fmt: skip
    results: dict[int, tuple[str, float, str]] = {}
    work: queue.Queue = queue.Queue()
    for item in todo:
        work.put(item)
    lock = threading.Lock()

    def worker() -> None:
        with tempfile.TemporaryDirectory(prefix="attnchecker-mutation-") as tmp:
            src = Path(tmp) / "src"
            shutil.copytree(ROOT / "src" / "attnchecker", src / "attnchecker",
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
            while True:
                try:
                    i, m = work.get_nowait()
                except queue.Empty:
                    return
                results[i] = r = _run(m, src, args.timeout)
                with lock:
                    print(f"[{len(results)}/{len(todo)}] {r[0]:>9} {r[1]:6.1f} s  "
                          f"{m.path}: {m.why}", file=sys.stderr, flush=True)  # fmt: skip

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = ["| # | module | change | outcome | s | note |", "|---|---|---|---|---|---|"]
    failed = 0
    for i, m in todo:
        outcome, secs, tail = results[i]
        note = m.why
        if outcome == "SURVIVED":
            if m.equivalent:
                outcome, note = "survived (equivalent)", f"{m.why}; equivalent: {m.equivalent}"
            else:
                failed += 1
        elif outcome == "killed" and m.equivalent:
            note = f"{m.why}; listed as equivalent but killed: drop the argument"
            failed += 1
        elif outcome.startswith("error"):
            note = f"{m.why}; {tail}"
            failed += 1
        change = f"`{m.old.strip()[:60]}` -> `{m.new.strip()[:60]}`".replace("|", "\\|")
        rows.append(f"| {i} | {m.path} | {change.replace(chr(10), ' ')} | {outcome} | "
                    f"{secs:.0f} | {note} |")  # fmt: skip
    killed = sum(results[i][0] == "killed" for i, _ in todo)
    rows.append(f"\n{killed} of {len(todo)} killed; {failed} to act on (survivors not argued "
                f"equivalent, errors, equivalents that were killed)")  # fmt: skip
    table = "\n".join(rows)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
