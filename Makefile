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

# The benchmarks (`python -m bench --help` lists them; docs/benchmarks.md has their figures).
# bench: the overhead against vllm-router and the floor, the full matrix, 3 runs, ~25 minutes.
# bench-smoke (CI): every benchmark in its quick mode, one after the other, seconds each; it
# fails when one does not run (a failed request, a process that cannot start, a leak), never on
# a timing.
bench: setup
	$(PY) -m bench overhead

bench-smoke: setup
	$(PY) -m bench --smoke

# Real vLLM (CPU) prefill and decode engines: its own venv, reused once built (docs/e2e.md).
e2e-vllm-setup:
	e2e/setup_vllm.sh

e2e-vllm: setup e2e-vllm-setup
	$(PY) -m pytest -m e2e_vllm --tb=short tests/e2e_vllm

demo-vllm: setup e2e-vllm-setup
	$(PY) -m e2e.demo_vllm

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
