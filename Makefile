# `make test` is what CI runs (.ci/run); it needs nothing but Python 3.11 on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest simulate serve demo bench clean

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

# The deterministic simulator (sim/README.md): the real EffectService against simulated parts, for
# SIM_SECONDS across fresh seeds; exits non-zero on any violation, printing its seed and shrunk schedule.
# The exhaustive model check (model/, issue 9 part 3) belongs here as a second recipe line.
SIM_SECONDS ?= 180
simulate: $(STAMP)
	$(BIN)/python -m sim run --seconds $(SIM_SECONDS)

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
