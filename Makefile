# `make test` is what CI runs (.ci/run); it needs nothing but Python 3.11 on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest fuzz serve demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

# The property tests with thousands of examples each (`make test` runs a few): long, not for CI.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q tests/test_jsonbody.py tests/test_fingerprint.py tests/test_outbound.py tests/test_wire.py

# The main job: the crash matrix of the reference article, on the embedded Postgres, with real SIGKILLs.
demo: $(STAMP)
	$(BIN)/effect-gateway demo

# The gateway alone, serving the example configuration on the embedded Postgres.
serve: $(STAMP)
	$(BIN)/effect-gateway serve --config examples/gateway.toml

bench: $(STAMP)
	$(BIN)/python -m bench.gateway_overhead
	$(BIN)/python -m bench.journal_step

clean:
	rm -rf $(VENV) .effect-gateway examples/.effect-gateway .pytest_cache .mypy_cache .ruff_cache
