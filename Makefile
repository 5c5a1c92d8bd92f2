# The README's two set-up commands: `make chat` (the app on the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint chat bench models fuzz clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py mlxlis/_blas_dispatch.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

models: install
	$(VENV)/bin/mlxlis pull

test: install models
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not real"

lint: install
	$(VENV)/bin/ruff check mlxlis tui tests scripts

chat: install models
	$(VENV)/bin/mlxlis chat

bench: install models
	$(PY) scripts/bench.py

fuzz: install
	MLXLIS_FUZZ_EXAMPLES=5000 $(PY) -m pytest -q tests -k fuzz

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
