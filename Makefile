# `make test` is what CI runs (.ci/run); it needs nothing but Python 3.11 on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest serve demo bench bench-load bench-growth clean

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

# The main job: the crash matrix of the reference article, on the embedded Postgres, with real SIGKILLs.
demo: $(STAMP)
	$(BIN)/effect-gateway demo

# The gateway alone, serving the example configuration on the embedded Postgres.
serve: $(STAMP)
	$(BIN)/effect-gateway serve --config examples/gateway.toml

bench: $(STAMP)
	$(BIN)/python -m bench.gateway_overhead
	$(BIN)/python -m bench.journal_step

# The gateway under load from outside its process (wrk, else bench.loadgen), beside a direct upstream
# and a pass-through proxy: `make bench-load WORKERS=1,N DURATION=10 REPEAT=3`. About 8 minutes per
# workers setting. PROFILE=dir adds py-spy profiles of the gateway at c=64 (needs py-spy in .venv).
WORKERS ?= 1
DURATION ?= 10
REPEAT ?= 3
PROFILE ?=
bench-load: $(STAMP)
	$(BIN)/python -m bench.gateway_load --workers $(WORKERS) --duration $(DURATION) --repeat $(REPEAT) \
		$(if $(PROFILE),--profile $(PROFILE))

# The gateway as its effects table grows: `make bench-growth ROWS=10000000`. About 20 minutes at 1M.
ROWS ?= 1000000
bench-growth: $(STAMP)
	$(BIN)/python -m bench.growth --rows $(ROWS)

clean:
	rm -rf $(VENV) .effect-gateway .pytest_cache .mypy_cache .ruff_cache
