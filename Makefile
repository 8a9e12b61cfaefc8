# One-command entry points. Every target installs what it needs into .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt

.PHONY: install demo test lint proto bench-cpu clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The CPU wheel of torch first, so nothing pulls a multi-GB CUDA build.
	$(PIP) install -q -c $(CONSTRAINTS) torch
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The main job: a local Ray with CPU workers, the coordinator on localhost, clients sharing a prefix.
demo: $(STAMP)
	$(VENV)/bin/kvcache demo

## Install everything, lint, and run the whole test suite (what CI runs).
test: $(STAMP)
	scripts/ensure-prometheus.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -ra

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## Regenerate the gRPC stubs from proto/ (committed, so installs need no protoc).
proto: $(STAMP)
	scripts/gen-proto.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
