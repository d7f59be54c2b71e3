"""``scripts/gpu_check.sh`` runs on this machine before a GPU is lent, so that it cannot fail on
a typo when one is: its first stage (``step``: ``benchmarks/gpu_step.py``, the training step of
the plain SDPA model, the projections' checks, the default config and ``all_linear``, arms
alternated, each row written
as measured) at tiny sizes on the CPU (``GPU_CHECK_TINY=1``), through the script's own stage
runner, budget and archive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_step_stage_runs_and_archives_its_rows(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable,
           "GPU_CHECK_STAGES": "bounds accumulator backward step calibrate", "GPU_CHECK_TINY": "1",
           "OUT": str(tmp_path), "ATTNCHECKER_CHECK_IMPL": "eager",
           "GPU_CHECK_BUDGET": "200"}  # fmt: skip
    r = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=280)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "step: rc 0" in r.stdout and "calibrate: rc 0" in r.stdout
    assert "bounds: rc 0" in r.stdout  # benchmarks/gemm_bounds.py, a smoke run here
    assert "accumulator: rc 0" in r.stdout  # benchmarks/acc_gemm.py, likewise
    assert "backward: rc 0" in r.stdout  # benchmarks/backward_sensitivity.py, likewise
    with tarfile.open(tmp_path / "gpu_check.tgz") as tar:
        text = tar.extractfile("gpu_check/step_rows.jsonl").read().decode()
        rows = [json.loads(line) for line in text.splitlines()]
        assert "gpu_check/step.log" in tar.getnames()
        kernel_rows = tar.extractfile("gpu_check/kernel_rows.jsonl").read().decode()
    # the calibration stage (benchmarks/kernel_times.py): every check kernel of the step, with
    # its grid, bytes, the time measured (the interpreter's here) and the model's charge
    (cal,) = [json.loads(line) for line in kernel_rows.splitlines()]
    kernels = {r["kernel"] for r in cal["launches"]}
    assert {"fwd_verify_kernel", "bwd_check_kernel", "weights_kernel",
            "norm_excess_kernel", "checked_adamw_kernel"} <= kernels, kernels  # (issue 57's)
    assert all(r["measured_us"] > 0 and r["modelled_us"] > 0 for r in cal["launches"])
    assert [(r["width"], r["mode"]) for r in rows] == [("base", "eager"), ("8b", "eager")]
    for row in rows:
        arms = {"sdpa", "core", "protected", "projections", "all_linear"}
        assert not row["errors"] and set(row["ms"]) == arms
        assert all(ms > 0 for ms in row["ms"].values())
        assert set(row["vs_sdpa"]) == arms - {"sdpa"}
