# The README's two commands: `make up` (set up, then run the main job) and
# `make test` (set up, then run the test suite). Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup up test proto bench
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py wire/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

up: setup
	$(BIN)/atoll up

test: setup
	$(BIN)/python -m pytest

proto: setup
	$(BIN)/python -m wire.codegen

bench: setup
	$(BIN)/atoll bench codec --json
