# Every target CI uses is here; .ci/run calls `make check`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup lint format types test test-system check demo clean e2e-vllm-setup e2e-vllm demo-vllm \
	bench bench-smoke

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check sidecar tests bench e2e devkit
	$(VENV)/bin/ruff format --check sidecar tests bench e2e devkit
	$(VENV)/bin/hadolint Dockerfile

format: setup
	$(VENV)/bin/ruff check --fix sidecar tests bench e2e devkit
	$(VENV)/bin/ruff format sidecar tests bench e2e devkit

types: setup
	$(VENV)/bin/mypy

# The main suite, on every core up to four (pytest-xdist; it passes with four workers on two
# cores too). The system tests (the `system` marker: packages, the project's programs in
# subprocesses, Redis Cluster, Chromium, seconds of wall time) apart, one at a time: they time
# what processes do, and in parallel one of them (a sidecar process against Redis) once ran past
# its 30 s limit.
test: setup
	$(PY) -m pytest -n auto --maxprocesses 4

test-system: setup
	$(PY) -m pytest -m system

check: lint types test

demo: setup
	$(PY) -m sidecar.demo

# Overhead against vllm-router and the floor (docs/benchmarks.md): the full matrix, 3 runs,
# ~25 minutes; the smoke run (one concurrency, a few hundred requests, no figure judged) in CI.
bench: setup
	$(PY) bench/overhead.py

bench-smoke: setup
	$(PY) bench/overhead.py --quick

# Real vLLM (CPU) prefill and decode engines: its own venv, reused once built (docs/e2e.md).
e2e-vllm-setup:
	e2e/setup_vllm.sh

e2e-vllm: setup e2e-vllm-setup
	$(PY) -m pytest -m e2e_vllm tests/e2e_vllm

demo-vllm: setup e2e-vllm-setup
	$(PY) -m e2e.demo_vllm

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
