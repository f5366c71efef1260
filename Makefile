# Every target CI uses is here; .ci/run calls `make check`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup lint format types test check demo clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check sidecar tests bench
	$(VENV)/bin/ruff format --check sidecar tests bench

format: setup
	$(VENV)/bin/ruff check --fix sidecar tests bench
	$(VENV)/bin/ruff format sidecar tests bench

types: setup
	$(VENV)/bin/mypy

test: setup
	$(PY) -m pytest

check: lint types test

demo: setup
	$(PY) -m sidecar.demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
