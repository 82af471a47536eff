# Two entry points: `make run` (the main job) and `make test` (the test suite).
# Both create .venv when it is missing. A Python that already has torch and triton (a CUDA machine)
# is reused through --system-site-packages, so no second copy of torch is downloaded.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup test-gpu test-gpu-quick test-gpu-slow fuzz-gpu
setup: $(BIN)/.ready

$(BIN)/.ready: pyproject.toml
	@if $(PYTHON) -c "import torch, triton" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q "torch==2.14.1" "torchvision==0.29.1"; \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

run: setup
	$(BIN)/dropin inject resnet18 --verify --bench

test: setup
	$(BIN)/python -m pytest -q -n auto

# The GPU suites, on a CUDA machine whose $(PYTHON) has torch, triton, pytest, pytest-xdist, hypothesis,
# torchvision and transformers (nothing is installed): the sources run from src/. Workers share the one GPU;
# REPORT=path names the junit XML file (default test-gpu*.xml here).
GPU_WORKERS ?= $(shell n=$$(nproc); [ $$n -gt 16 ] && n=16; echo $$n)
GPU_PYTEST = PYTHONPATH=src $(PYTHON) -m pytest -q -n $(GPU_WORKERS) --dist worksteal -p no:cacheprovider
# items handed out one at a time in collection order (xdist's load scheduling otherwise sends each worker a block of
# a quarter of its share first: the first worker took every one of the longest tests, which conftest puts first)
IN_ORDER = --dist load --maxschedchunk 1

test-gpu:         # every GPU test but the slow sweeps and the fuzz suite (under 8 minutes on one H100);
                  # items handed out in order (IN_ORDER), the longest tests first (tests/_suites.py)
	$(GPU_PYTEST) $(IN_ORDER) -m "not slow and not fuzz" --junitxml=$(or $(REPORT),test-gpu.xml) tests

test-gpu-quick:   # each public op, injector handler and execution mode once (under 2 minutes)
	$(GPU_PYTEST) -m quick --junitxml=$(or $(REPORT),test-gpu-quick.xml) tests

test-gpu-slow:    # the sweeps test-gpu leaves out: every kernel config, long fp32 attention, full-size CLI runs;
                  # PART=1 test_attention.py's and the full-size CLI runs (its longest tests, ~5 min each beside
                  # the attention sweeps), PART=2 the others (a run each, for runs under 10 minutes);
                  # items handed out in order (IN_ORDER), the longest tests first (tests/_suites.py)
	$(GPU_PYTEST) $(IN_ORDER) -m slow --junitxml=$(or $(REPORT),test-gpu-slow.xml) $(SLOW_TESTS_$(or $(PART),ALL))

SLOW_TESTS_ALL = tests
SLOW_TESTS_1 = tests/ops/test_attention.py tests/test_cli_inject.py
SLOW_TESTS_2 = tests --ignore=tests/ops/test_attention.py --ignore=tests/test_cli_inject.py

fuzz-gpu:         # tests/fuzz's hypothesis suite, DROPIN_FUZZ_EXAMPLES cases an op (default 600: ~10,500 in all);
                  # items handed out in order (IN_ORDER), the slowest tests' first (tests/fuzz/conftest.py)
	$(GPU_PYTEST) $(IN_ORDER) -m fuzz --junitxml=$(or $(REPORT),fuzz-gpu.xml) tests/fuzz
