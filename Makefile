# The README's two commands: `make up` (set up atoll, then run the main job) and
# `make test` (set up atoll with its test extras, then run the test suite). Both create
# .venv on first use; the targets that run tests, linters or codegen add the extras.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup setup-test up test test-fast image-check lint typecheck format proto bench
setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

# atoll and its runtime dependencies alone
$(VENV)/.installed: pyproject.toml setup.py wire/_kernels.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# then the test extras: pytest, ruff, mypy, grpcio-tools, kmock, ...
$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

up: setup
	$(BIN)/atoll up

test: setup-test
	$(BIN)/python -m pytest

# the unit tests alone: not the whole-run tier (e2e) nor tests/integration/'s real servers
# and processes (marked integration by tests/integration/conftest.py)
test-fast: setup-test
	$(BIN)/python -m pytest -m "not e2e and not integration"

# the Dockerfile's build and its checks, without a container engine (part of `make test`)
image-check: setup-test
	$(BIN)/python -m pytest tests/integration/test_image.py

lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck

# mypy (strict, [tool.mypy]) on server/, learner/ and wire/ as the packages atoll.server,
# atoll.learner and atoll.wire. The editable install maps them with an import hook mypy
# cannot see, so build/typecheck/atoll/ links them in under their real names;
# [tool.mypy]'s mypy_path puts that tree ahead of the repo's own ./atoll.
# the application layer (atoll/): every module but atoll/__init__.py, which re-exports the
# library (linked here as an empty package so the library is checked as its own packages)
TYPED_APP := cli.py commands.py export.py model_dir.py sample.py plan.py cluster faults local bench
typecheck: setup-test
	mkdir -p build/typecheck/atoll
	touch build/typecheck/atoll/__init__.py
	ln -sfn ../../../server build/typecheck/atoll/server
	ln -sfn ../../../learner build/typecheck/atoll/learner
	ln -sfn ../../../wire build/typecheck/atoll/wire
	for m in $(TYPED_APP); do ln -sfn ../../../atoll/$$m build/typecheck/atoll/$$m; done
	$(BIN)/mypy -p atoll.server -p atoll.learner -p atoll.wire -p atoll.cluster -p atoll.faults \
	    -p atoll.local -p atoll.bench -m atoll.cli -m atoll.commands -m atoll.export \
	    -m atoll.model_dir -m atoll.sample -m atoll.plan

format: setup-test
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

proto: setup-test
	$(BIN)/python -m atoll.wire.codegen

bench: setup
	$(BIN)/atoll bench codec --json
