#!/usr/bin/env bash
# The GPU check, in one command of about 8 minutes, on a machine with CUDA torch, triton and
# transformers preinstalled and no package registry:
#
#   bash scripts/gpu_check.sh            # from the repo root (it cds there itself)
#
# Stages, each under `timeout` inside an overall budget (GPU_CHECK_BUDGET seconds, 480 by
# default), run in the order GPU_CHECK_STAGES gives (default: all, most telling first); every
# stage runs even when an earlier one fails, and the exit status is 0 only when all succeeded:
# - bounds: benchmarks/gemm_bounds.py, the GEMM checks' rounding-tight bound (issue 55) on
#   cuBLAS's own GEMMs at base and Llama-8B shapes, bf16 / fp16 / fp32, bf16 split-K reductions
#   in fp32 and in bf16: each clean row's |residual| / tolerance (the margin the probabilistic
#   accumulation term leaves; 1 is a false alarm) and the smallest error seen;
# - accumulator: benchmarks/acc_gemm.py, the accumulator GEMM (check_impl="accumulator", opt-in
#   until this stage has timed it): its bound's margin on the device's matrix units, the
#   smallest accumulator error it sees, and its time against cuBLAS at base and Llama-8B shapes;
# - backward: benchmarks/backward_sensitivity.py --device cuda, the backward's checks on the
#   device's own GEMMs and SDPA kernels (the eager core's dQ / dV, the route's sums, the sampled
#   rows' per-element bounds): thresholds and false alarms in clean products;
# - step: benchmarks/gpu_step.py, the training step of the plain SDPA model, the core's checks
#   alone and the default config (both on the SDPA route, backend="auto" on CUDA), the
#   projections' checks alone and all_linear (the GEMM checks as registered Triton ops:
#   check_impl="auto" on CUDA), eager / CUDA graph / compiled, at base width (L 1024) and Llama-8B widths
#   (L 4096), arms alternated, each row written as measured (step_rows.jsonl);
# - calibrate: benchmarks/kernel_times.py, every check kernel of one protected step (Llama-8B
#   widths and base width, 1 layer; the norms' and the update's kernels of issue 57 included)
#   timed alone with CUDA events against the cost model's charge, and the device constants
#   fitted (bandwidth, per-program rate, floor: issue 54);
# - tests: the `gpu` tests (tests/integration/test_gpu.py: the SDPA route's among them) and the
#   fused kernels' tests
#   (tests/unit/kernels, compiled for the GPU, no interpreter) with the system python, failing
#   when any of them is skipped (they must really run on the GPU);
# - tune: benchmarks/tune_launch.py, the kernels' launch settings timed over a grid;
# - benchmark: benchmarks/protect_vs_sdpa.py on CUDA, eager model, checks as eager ops, with the
#   fused kernels' arm;
# - gemm: benchmarks/gemm_check.py, one checked GEMM eager, compiled and as Triton kernels,
#   profiled;
# - auto: protect_vs_sdpa.py with the default check_impl (compiled check regions);
# - alarms: benchmarks/kernel_false_alarms.py, clean forward + backward of the kernels over
#   bf16, fp16, fp32 with TF32 off and on: every check's alarms must be 0;
# - kernels: benchmarks/flash_kernels.py, checked vs unchecked kernels vs SDPA;
# - compiled: protect_vs_sdpa.py under torch.compile (llama, L 1024).
# (tests/unit/kernels/test_compile.py is a CPU-side check of the compiled code and is not run.)
#
# Wheels in .whl/ (a newer transformers than the machine's, say) are installed first into a
# temporary folder put on PYTHONPATH. When $OUT is set (the device runner's output folder), the
# results written under benchmarks/results/ and every stage's log go into $OUT/gpu_check.tgz.
#
# Environment: PYTHON (default: python3 on PATH), GPU_CHECK_BUDGET (480), GPU_CHECK_STAGES,
# GPU_CHECK_WORKERS (16), GPU_CHECK_ALARM_ARMS (all four),
# GPU_CHECK_{BOUNDS,ACC,BACKWARD,STEP,CALIBRATE,TEST,TUNE,BENCH,GEMM,AUTO,ALARM,KERNEL,COMPILED}_TIMEOUT
# (60, 60, 60, 240, 90, 150, 150, 70, 40, 100, 100, 75, 60), OUT; GPU_CHECK_TINY=1 runs the step and
# calibrate stages on the CPU at tiny sizes (tests/integration/test_gpu_stage.py runs them so).
# Measured on an H200 (2026-12-04): tests 111 s with 16 workers, the alarm sweep ~90 s, the
# kernels' benchmark ~60 s; the protect_vs_sdpa rows build 4 base-width models each.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECONDS=0

PY=${PYTHON:-$(command -v python3 || command -v python || true)}
if [[ -z "$PY" ]]; then
    echo "gpu_check: no python3 or python on PATH" >&2
    exit 2
fi
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-240}
BOUNDS_TIMEOUT=${GPU_CHECK_BOUNDS_TIMEOUT:-60}
ACC_TIMEOUT=${GPU_CHECK_ACC_TIMEOUT:-60}
BACKWARD_TIMEOUT=${GPU_CHECK_BACKWARD_TIMEOUT:-60}
CALIBRATE_TIMEOUT=${GPU_CHECK_CALIBRATE_TIMEOUT:-90}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-150}
ALARM_TIMEOUT=${GPU_CHECK_ALARM_TIMEOUT:-100}
KERNEL_TIMEOUT=${GPU_CHECK_KERNEL_TIMEOUT:-75}
BENCH_TIMEOUT=${GPU_CHECK_BENCH_TIMEOUT:-70}
GEMM_TIMEOUT=${GPU_CHECK_GEMM_TIMEOUT:-40}
COMPILED_TIMEOUT=${GPU_CHECK_COMPILED_TIMEOUT:-60}
TUNE_TIMEOUT=${GPU_CHECK_TUNE_TIMEOUT:-150}
AUTO_TIMEOUT=${GPU_CHECK_AUTO_TIMEOUT:-100}
BUDGET=${GPU_CHECK_BUDGET:-480}
OUT_DIR=${OUT:-}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
touch "$work/stamp"

site=""
if compgen -G ".whl/*.whl" >/dev/null; then
    site="$work/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || echo "gpu_check: installing .whl/ failed"
fi
export PYTHONPATH="$PWD/src${site:+:$site}"  # the package from the source tree
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export PYTHONDONTWRITEBYTECODE=1
export PYTHONUNBUFFERED=1

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
results=()

# stage NAME LIMIT CMD...: run CMD under `timeout` (LIMIT, or less when the budget is short),
# its output in $work/NAME.log; a failure marks the run failed and the next stage still runs
stage() {
    local name=$1 limit rc=0
    limit=$(cap "$2")
    shift 2
    if ((limit < 20)); then
        echo "gpu_check: no time left for $name (${limit}s)"
        results+=("$name: no time")
        status=1
        return
    fi
    echo "== $name (timeout ${limit}s)"
    # SIGINT first: pytest and the benchmarks then print what they have before they stop
    timeout -s INT -k 15 "$limit" "$@" 2>&1 | tee "$work/$name.log" || rc=$?
    if ((rc == 124 || rc == 137)); then echo "gpu_check: $name TIMED OUT after ${limit}s"; fi
    if ((rc != 0)); then
        echo "gpu_check: $name FAILED (rc $rc)"
        status=1
    fi
    results+=("$name: rc $rc")
}

# ---------------------------------------------------------------- the stages
# each a function; GPU_CHECK_STAGES names those to run, in order (default: all, most telling
# first; a stage the budget has no room for is reported as "no time")

# the training step where users train (see the header); GPU_CHECK_TINY: on the CPU, tiny
run_step() {
    local tiny=()
    if [[ -n "${GPU_CHECK_TINY:-}" ]]; then tiny=(--tiny --device cpu --modes eager --reps 2); fi
    stage step "$STEP_TIMEOUT" "$PY" benchmarks/gpu_step.py --out "$work/step_rows.jsonl" \
        "${tiny[@]}"
}

# every check kernel of a protected step timed alone, against the cost model (issue 54)
run_calibrate() {
    local tiny=()
    if [[ -n "${GPU_CHECK_TINY:-}" ]]; then tiny=(--tiny --reps 1); fi
    stage calibrate "$CALIBRATE_TIMEOUT" "$PY" benchmarks/kernel_times.py \
        --out "$work/kernel_rows.jsonl" "${tiny[@]}"
}

# the GEMM checks' rounding-tight bound on the device's GEMMs: margins, alarms, thresholds
run_bounds() {
    local tiny=()
    if [[ -n "${GPU_CHECK_TINY:-}" ]]; then tiny=(--quick --device cpu); fi
    stage bounds "$BOUNDS_TIMEOUT" "$PY" benchmarks/gemm_bounds.py "${tiny[@]}"
}

# the accumulator GEMM: its margin, threshold and time against cuBLAS (issue 55, item 2)
run_accumulator() {
    local tiny=()
    if [[ -n "${GPU_CHECK_TINY:-}" ]]; then tiny=(--quick --device cpu); fi
    stage accumulator "$ACC_TIMEOUT" "$PY" benchmarks/acc_gemm.py "${tiny[@]}"
}

# the backward's checks on the device's GEMMs and SDPA kernels: thresholds, false alarms
run_backward() {
    local args=(--device cuda --clean 40)
    if [[ -n "${GPU_CHECK_TINY:-}" ]]; then args=(--quick --device cpu); fi
    stage backward "$BACKWARD_TIMEOUT" "$PY" benchmarks/backward_sensitivity.py "${args[@]}"
}

# the gpu tests and the kernels' tests, compiled for the device, with tests/conftest.py as on
# a CPU (it sets TRITON_INTERPRET only without CUDA; its ATTNCHECKER_CHECK_IMPL=eager is
# overridden by test_gpu.py, whose checks run the CUDA default, CHECK_IMPL there, asserted by
# test_the_checks_run_the_cuda_default). -p no:timeout: the outer timeout rules. With pytest-xdist,
# GPU_CHECK_WORKERS processes compile the kernels side by side; -v: each test's outcome as it
# ends (a run cut short still names what failed).
run_tests() {
    local xdist=()
    if "$PY" -c "import xdist" 2>/dev/null; then xdist=(-n "${GPU_CHECK_WORKERS:-16}"); fi
    stage tests "$TEST_TIMEOUT" "$PY" -m pytest -v --tb=short -m "not slow" "${xdist[@]}" \
        tests/integration/test_gpu.py tests/unit/kernels \
        --ignore=tests/unit/kernels/test_compile.py \
        -p no:cacheprovider -p no:timeout -rfEs --junitxml="$work/junit.xml"
    # the tests must have run: none skipped, none failed, at least one passed
    if ! "$PY" - "$work/junit.xml" <<'EOF2'; then
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
EOF2
        status=1
        results+=("tests: not all passed")
    fi
}

# the launch settings of the fused kernels: a grid of candidates timed on the device
run_tune() {
    stage tune "$TUNE_TIMEOUT" "$PY" benchmarks/tune_launch.py --dims 64 128 --length 4096 \
        --jobs "${GPU_CHECK_WORKERS:-16}" --budget $(($(cap "$TUNE_TIMEOUT") * 4 / 5))
}

# protect_ vs SDPA on CUDA, eager model, the checks as eager ops (no compilation to wait for)
# and the default config on the fused kernels
run_benchmark() {
    ATTNCHECKER_CHECK_IMPL=eager stage benchmark "$BENCH_TIMEOUT" "$PY" \
        benchmarks/protect_vs_sdpa.py --device cuda --families llama gpt2 --lengths 1024 \
        --dtypes bf16 --compile eager --arms protected triton --reps 5 --tag eager_checks
}

# one checked GEMM: the backward's check eager, as an inductor region and as the hand-written
# Triton kernels (check_impl="triton"), against the GEMM it checks, each arm profiled
run_gemm() {
    stage gemm "$GEMM_TIMEOUT" "$PY" benchmarks/gemm_check.py --device cuda --reps 50 \
        --dtypes bf16 --tokens 8192 --profile
}

# protect_ vs SDPA with the default check_impl ("auto": compiled check regions); inductor
# compiles in this process (run 2's worker pool failed in a subprocess)
run_auto() {
    TORCHINDUCTOR_COMPILE_THREADS=1 stage auto "$AUTO_TIMEOUT" "$PY" \
        benchmarks/protect_vs_sdpa.py --device cuda --families llama --lengths 1024 \
        --dtypes bf16 --compile eager --arms protected --reps 5 --tag auto_checks
}

# clean forward + backward of the kernels over bf16 / fp16 / fp32 / fp32+TF32; rc 1: alarms
run_alarms() {
    stage alarms "$ALARM_TIMEOUT" "$PY" benchmarks/kernel_false_alarms.py --lengths 1024 4096 \
        --dims 64 128 ${GPU_CHECK_ALARM_ARMS:+--arms $GPU_CHECK_ALARM_ARMS}
}

# checked vs unchecked kernels vs SDPA
run_kernels() {
    stage kernels "$KERNEL_TIMEOUT" "$PY" benchmarks/flash_kernels.py --lengths 1024 4096 \
        16384 --dims 64 128
}

# protect_ vs SDPA under torch.compile (llama, L 1024)
run_compiled() {
    stage compiled "$COMPILED_TIMEOUT" "$PY" benchmarks/protect_vs_sdpa.py --device cuda \
        --families llama --lengths 1024 --dtypes bf16 --compile compiled --arms protected \
        triton --reps 5 --tag compiled
}

for name in ${GPU_CHECK_STAGES:-bounds accumulator backward step calibrate tests gemm benchmark auto alarms kernels tune compiled}; do
    if ! declare -F "run_$name" >/dev/null; then
        echo "gpu_check: no stage $name"
        status=1
        continue
    fi
    "run_$name"
done

# ---------------------------------------------------------------- results
new=$(find benchmarks/results -type f -newer "$work/stamp" 2>/dev/null || true)
echo "== files written under benchmarks/results:"
echo "${new:-  (none)}"
if [[ -n "$OUT_DIR" && -d "$OUT_DIR" ]]; then
    # the device runner brings back at most 8 files: one archive holds the results and logs
    mkdir -p "$work/gpu_check"
    cp "$work"/*.log "$work/gpu_check/" 2>/dev/null || true
    cp "$work/junit.xml" "$work"/*.jsonl "$work/gpu_check/" 2>/dev/null || true
    # shellcheck disable=SC2086  # $new: one path per word
    tar -czf "$OUT_DIR/gpu_check.tgz" $new -C "$work" gpu_check
    echo "gpu_check: results and logs in $OUT_DIR/gpu_check.tgz"
fi

echo "== gpu_check: ${results[*]}; ${SECONDS}s"
exit "$status"
