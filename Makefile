# Two entry points: `make run` (the main job) and `make test` (the test suite).
# Both create .venv when it is missing. A Python that already has torch and triton (a CUDA machine)
# is reused through --system-site-packages, so no second copy of torch is downloaded.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup
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
