# Two commands on a fresh clone: `make demo` and `make test`. Each sets up .venv when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-all lint bench docs screenshots setup clean

setup: $(STAMP)

# torch first and pinned: anything that depends on torch must find it already installed, or pip
# would resolve an unpinned torch to a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnchecker demo

# two workers (pytest-xdist; each test owns its processes, ports and temp dirs), stealing work
# so the long compile tests do not queue behind each other; then the examples of the README and
# docs/ in one process (a page's examples share a namespace and its skip directives apply to the
# next example: split across workers, a skip was lost and a GPU-only example ran)
test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks conftest.py
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests
	$(BIN)/python -m pytest -q -n 0 README.md docs

# every test, then the curated mutation run (scripts/mutation.py, tests/mutation/mutants.py:
# one-line changes to the modules that carry the README's promises, each must fail a test;
# about 11 minutes on 2 cores: benchmarks/results/mutation_cpu2_2026-12-06.md)
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m "" -n 2 --dist worksteal tests
	$(BIN)/python -m pytest -q -m "" -n 0 README.md docs
	$(BIN)/python scripts/mutation.py --jobs 2

# the package's layers and no import cycles: the contracts in pyproject.toml's [tool.importlinter]
lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks conftest.py
	$(BIN)/ruff format --check src tests benchmarks conftest.py
	$(BIN)/lint-imports --no-cache

# every benchmark at its full size (an estimated 25-35 minutes on 2 idle CPU cores; results in
# benchmarks/results/), or `make bench QUICK=1`: each at its --quick size (2-5 minutes; files
# named *_quick_* in $BENCH_QUICK_DIR, default <tempdir>/attnchecker-bench, never over a full
# result). protect_vs_sdpa runs its eager L = 128 rows here; its default adds L = 1024 and
# torch.compile (about 45-75 minutes more on this CPU).
bench: $(STAMP)
	$(BIN)/python benchmarks/abft_overhead.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/detection_threshold.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/check_sensitivity.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/backward_sensitivity.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/gemm_check.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/check_impl.py $(if $(QUICK),--quick,--reps 16)
	$(BIN)/python benchmarks/clean_false_alarms.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/flash_kernels.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/kernel_false_alarms.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/protect_vs_sdpa.py $(if $(QUICK),--quick,--lengths 128 --compile eager --reps 10 --tag regions_all_l128)
	$(BIN)/python benchmarks/own_model.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/recovery_cost.py $(if $(QUICK),--quick)
	$(BIN)/python benchmarks/sdc_detectors.py $(if $(QUICK),--quick)

# the reference pages (docs/, mkdocs.yml) into site/, strictly: a broken link or a docstring the
# API reference cannot render fails it (make test builds them too: tests/docs/test_docs.py)
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

# the HTML reports in headless Chromium (apt-get install chromium), into docs/screenshots/
screenshots: $(STAMP)
	scripts/screenshots.sh docs/screenshots

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
