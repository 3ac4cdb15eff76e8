# `make test` is what CI runs (.ci/run); it needs nothing but Python 3.11 on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest fuzz spin model-check chromium serve demo bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: lint typecheck spin pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) chromium
	$(BIN)/pytest

# The property tests with thousands of examples each (`make test` runs a few): long, not for CI.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q tests/test_jsonbody.py tests/test_fingerprint.py tests/test_outbound.py tests/test_wire.py
# The exhaustive model of the effect state machine (model/README.md) needs spin and a C compiler.
# CI runs as root on Debian: install them there; elsewhere say what is missing (tests/test_model.py
# then fails with the same reason, it never skips).
spin:
	@command -v spin >/dev/null && command -v cc >/dev/null || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq spin gcc >/dev/null; \
	else \
		echo "model check: spin or a C compiler is missing; install them (Debian/Ubuntu: apt-get install spin gcc)"; \
	fi

# Every designed configuration, every mutation and finding, every reachability witness (a few minutes).
model-check: spin
	$(PYTHON) model/check.py

# tests/test_audit_browser.py drives Debian's Chromium. CI runs as root on Debian, so it is installed here
# when missing; anywhere else this says why it cannot be, and those tests fail with the same reason.
CHROMIUM := /usr/bin/chromium
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "$(CHROMIUM) is missing and cannot be installed here (needs root and apt-get):" \
			"tests/test_audit_browser.py will fail; install Debian's chromium"; \
	fi

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
