# kvlb: every target installs what it needs itself (venv, pip packages, redis-server).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install redis lint typecheck test test-fast demo bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Tests start their own redis-server on a free port; this only makes sure the binary exists.
redis:
	@command -v redis-server >/dev/null 2>&1 || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server; }

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check balancer replicas tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy balancer

test: $(STAMP) redis lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -x -m "not slow"

bench: $(STAMP)
	$(VENV)/bin/kvlb bench index

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
