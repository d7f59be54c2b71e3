#!/usr/bin/env bash
# The GPU check, in one command of at most 6 minutes, on a machine with CUDA torch and
# transformers preinstalled and no package registry (nothing is installed here):
#
#   bash scripts/gpu_check.sh            # from the repo root (it cds there itself)
#
# 1. the `gpu` tests (tests/integration/test_gpu.py) and the fused kernels' tests
#    (tests/unit/kernels: compiled for the GPU, no interpreter) with the system python, failing
#    when any of them is skipped (they must really run on the GPU),
# 2. benchmarks/protect_vs_sdpa.py on CUDA and
# 3. benchmarks/flash_kernels.py (checked vs unchecked kernels vs SDPA, and the false-alarm
#    count on real MMAs) and
# 4. benchmarks/kernel_false_alarms.py: clean forward + backward of the kernels over bf16 (the
#    native bf16 path, never run by the interpreter), fp16, fp32 with TF32 off and on, scales
#    0.1 .. 30: every check's alarms must be 0 (the calibration of the derived tolerances),
# 5. benchmarks/gemm_check.py --device cuda: one checked GEMM eager, as a compiled region and
#    as the Triton kernels of check_impl="triton";
#    all write under benchmarks/results/. (tests/unit/kernels/test_compile.py is a CPU-side
#    check of the compiled code for triton 3.7.1 and is not run here.)
#
# Every stage runs even when an earlier one fails; the exit status is 0 only when all succeeded.
# Each stage runs under `timeout`, inside an overall budget (GPU_CHECK_BUDGET seconds, 360 by
# default), so the whole script ends within 6 minutes. When $OUT is set (the device runner's
# output folder), the files the benchmark wrote under benchmarks/results/ (same relative paths)
# and the two stages' logs and junit report (gpu_check_*) are copied there. The benchmark writes
# its results only when it finishes; its per-row lines are in gpu_check_benchmark.log even if
# the timeout stops it.
#
# Environment: PYTHON (default: python3 on PATH), GPU_CHECK_TEST_TIMEOUT (110),
# GPU_CHECK_BENCH_TIMEOUT (90), GPU_CHECK_KERNEL_TIMEOUT (80), GPU_CHECK_ALARM_TIMEOUT (60),
# GPU_CHECK_GEMM_TIMEOUT (45), GPU_CHECK_BUDGET (360), OUT (optional).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS=0

PY=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z "$PY" ]]; then
    echo "gpu_check: no python3 or python on PATH" >&2
    exit 2
fi
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-110}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-90}
KERNEL_TIMEOUT=${GPU_CHECK_KERNEL_TIMEOUT:-80}
ALARM_TIMEOUT=${GPU_CHECK_ALARM_TIMEOUT:-60}
GEMM_TIMEOUT=${GPU_CHECK_GEMM_TIMEOUT:-45}
BUDGET=${GPU_CHECK_BUDGET:-360}
OUT_DIR=${OUT:-}

export PYTHONPATH="$PWD/src"  # the package from the source tree, not an installed copy
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
touch "$work/stamp"

left() { echo $((BUDGET - SECONDS)); }
cap() { # cap SECONDS: the stage limit, no more than the budget left (less 10 s of slack)
    local room=$(($(left) - 10))
    ((room < $1)) && echo "$room" || echo "$1"
}

echo "== gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), python: $PY, budget ${BUDGET}s"
echo "== nvidia-smi"
timeout 20 nvidia-smi 2>&1 || echo "gpu_check: nvidia-smi failed or is missing"

echo "== versions"
timeout 60 "$PY" - <<'EOF' || echo "gpu_check: version probe failed"
import importlib, platform, sys

print("python", sys.version.split()[0], platform.platform())
for name in ("torch", "triton", "transformers", "pytest", "pytest_timeout", "hypothesis"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:14s}", getattr(mod, "__version__", "?"))
    except Exception as exc:
        print(f"{name:14s} not importable ({type(exc).__name__}: {exc})")
import torch

print("cuda available", torch.cuda.is_available(), "| torch.version.cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
    m = torch.backends.cuda.matmul
    print("matmul allow_tf32", m.allow_tf32,
          "| bf16 reduced-precision reduction", m.allow_bf16_reduced_precision_reduction)
import attnchecker

print("attnchecker from", attnchecker.__file__)
EOF

status=0

# ---------------------------------------------------------------- 1. the gpu tests
# --noconftest keeps tests/conftest.py (it needs hypothesis, which may be absent here, and would
# set TRITON_INTERPRET without CUDA) out: this script exports the offline variables it sets.
# -p no:timeout: pytest-timeout may be absent, the outer timeout rules.
t=$(cap "$TEST_TIMEOUT")
echo "== tests (timeout ${t}s)"
test_rc=0
timeout -k 5 "$t" "$PY" -m pytest -q -m "not slow" tests/integration/test_gpu.py tests/unit/kernels \
    --ignore=tests/unit/kernels/test_compile.py -p no:cacheprovider -p no:timeout --noconftest -rfEs \
    --junitxml="$work/junit.xml" 2>&1 | tee "$work/pytest.log" || test_rc=$?
if ((test_rc == 124 || test_rc == 137)); then
    echo "gpu_check: tests TIMED OUT after ${t}s"
fi
# the tests must have run: none skipped, none failed, at least one passed
if ! "$PY" - "$work/junit.xml" <<'EOF'; then
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"gpu_check: no junit report ({exc})")
    sys.exit(1)
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "skipped", "failures", "errors")}
passed = n["tests"] - n["skipped"] - n["failures"] - n["errors"]
print(f"gpu_check: tests {n['tests']}, passed {passed}, skipped {n['skipped']}, "
      f"failed {n['failures']}, errors {n['errors']}")
if n["skipped"]:
    print("gpu_check: gpu tests were SKIPPED: they did not run on a CUDA device")
    sys.exit(1)
if n["failures"] or n["errors"] or passed <= 0:
    print("gpu_check: gpu tests did not all pass")
    sys.exit(1)
EOF
    if ((test_rc == 0)); then test_rc=1; fi
fi
if ((test_rc != 0)); then
    echo "gpu_check: TESTS FAILED (rc $test_rc)"
    status=1
else
    echo "gpu_check: tests passed"
fi

# ---------------------------------------------------------------- 2. the benchmark
bench_rc=0
t=$(cap "$BENCH_TIMEOUT")
if [[ ! -f benchmarks/protect_vs_sdpa.py ]]; then
    echo "gpu_check: benchmarks/protect_vs_sdpa.py is missing"
    bench_rc=2
elif ((t < 20)); then
    echo "gpu_check: no time left for the benchmark (${t}s)"
    bench_rc=124
else
    echo "== benchmark (timeout ${t}s)"
    timeout -k 5 "$t" "$PY" benchmarks/protect_vs_sdpa.py --device cuda \
        --families gpt2 llama --lengths 128 1024 4096 --dtypes bf16 \
        --compile eager compiled --compile-max-len 128 --reps 5 2>&1 | tee "$work/benchmark.log" || bench_rc=$?
    if ((bench_rc == 124 || bench_rc == 137)); then
        echo "gpu_check: benchmark TIMED OUT after ${t}s"
    fi
fi
if ((bench_rc != 0)); then
    echo "gpu_check: BENCHMARK FAILED (rc $bench_rc)"
    status=1
else
    echo "gpu_check: benchmark done"
fi

# ---------------------------------------------------------------- 3. the kernels' benchmark
kernel_rc=0
t=$(cap "$KERNEL_TIMEOUT")
if ((t < 20)); then
    echo "gpu_check: no time left for the kernels' benchmark (${t}s)"
    kernel_rc=124
else
    echo "== kernels' benchmark (timeout ${t}s)"
    (cd benchmarks && timeout -k 5 "$t" "$PY" flash_kernels.py --lengths 1024 4096 16384 \
        --dims 64 128) 2>&1 | tee "$work/kernels.log" || kernel_rc=$?
fi
if ((kernel_rc != 0)); then
    echo "gpu_check: KERNELS' BENCHMARK FAILED (rc $kernel_rc)"
    status=1
else
    echo "gpu_check: kernels' benchmark done"
fi

# ---------------------------------------------------------------- 4. the false-alarm sweep
alarm_rc=0
t=$(cap "$ALARM_TIMEOUT")
if ((t < 20)); then
    echo "gpu_check: no time left for the false-alarm sweep (${t}s)"
    alarm_rc=124
else
    echo "== kernels' false alarms, bf16 / fp16 / fp32 / fp32+tf32 (timeout ${t}s)"
    (cd benchmarks && timeout -k 5 "$t" "$PY" kernel_false_alarms.py --lengths 1024 4096 \
        --dims 64 128) 2>&1 | tee "$work/alarms.log" || alarm_rc=$?
fi
if ((alarm_rc != 0)); then
    echo "gpu_check: FALSE-ALARM SWEEP FAILED (rc $alarm_rc: 1 means alarms on clean data)"
    status=1
else
    echo "gpu_check: false-alarm sweep done, 0 alarms"
fi

# ---------------------------------------------------------------- 5. one checked GEMM
# the backward's GEMM check eager, as an inductor region and as the hand-written Triton kernels
# (check_impl="triton"), against the GEMM it checks
gemm_rc=0
t=$(cap "$GEMM_TIMEOUT")
if ((t < 20)); then
    echo "gpu_check: no time left for the GEMM check's benchmark (${t}s)"
    gemm_rc=124
else
    echo "== one checked GEMM: eager / compiled / triton (timeout ${t}s)"
    (cd benchmarks && timeout -k 5 "$t" "$PY" gemm_check.py --device cuda --reps 50 --dtypes bf16 \
        --tokens 8192) 2>&1 | tee "$work/gemm.log" || gemm_rc=$?
fi
if ((gemm_rc != 0)); then
    echo "gpu_check: GEMM CHECK BENCHMARK FAILED (rc $gemm_rc)"
    status=1
else
    echo "gpu_check: GEMM check benchmark done"
fi

# ---------------------------------------------------------------- results
new=$(find benchmarks/results -type f -newer "$work/stamp" 2>/dev/null || true)
echo "== files written under benchmarks/results:"
echo "${new:-  (none)}"
if [[ -n "$OUT_DIR" && -d "$OUT_DIR" ]]; then
    if [[ -n "$new" ]]; then
        while IFS= read -r f; do cp --parents "$f" "$OUT_DIR/"; done <<<"$new"
    fi
    for f in junit.xml pytest.log benchmark.log kernels.log alarms.log gemm.log; do
        if [[ -f "$work/$f" ]]; then cp "$work/$f" "$OUT_DIR/gpu_check_$f"; fi
    done
    echo "gpu_check: copied to $OUT_DIR"
fi

echo "== gpu_check: tests rc $test_rc, benchmark rc $bench_rc, kernels rc $kernel_rc," \
    "alarms rc $alarm_rc, ${SECONDS}s"
exit "$status"
