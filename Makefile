# Two commands on a fresh clone: `make demo` and `make test`. Each sets up .venv when needed.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-all lint bench screenshots setup clean

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

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ""

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/abft_overhead.py
	$(BIN)/python benchmarks/detection_threshold.py
	$(BIN)/python benchmarks/check_sensitivity.py
	$(BIN)/python benchmarks/protect_vs_sdpa.py
	$(BIN)/python benchmarks/recovery_cost.py

# the HTML reports in headless Chromium (apt-get install chromium), into docs/screenshots/
screenshots: $(STAMP)
	scripts/screenshots.sh docs/screenshots

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
