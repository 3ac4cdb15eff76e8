# `make test` is what CI runs (.ci/run); it needs nothing but Python 3.11 on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck pytest fuzz spin model-check chromium postgres15 pgbouncer promtool test-pgbouncer failover simulate serve demo bench bench-against bench-mcp bench-load bench-growth bench-memory bench-input clean

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

# Tests run in parallel (pytest-xdist), each worker with a Postgres of its own: the embedded server, or
# a database of its own beside TEST_DATABASE_URL's. Two workers per CPU: many tests wait on processes
# they started, on timeouts and on Postgres, and a worker that waits leaves its CPU to another (on two
# cores: 250 s with two workers, 168 s with four, 177 s with six). A file's tests stay together, in
# order, on one worker: the blocks of a documentation page build on the ones before them.
# PYTEST_WORKERS=0 runs them in this process, one after another.
# The CPUs this process may use (a container's limit, not the host's cores), where the system says.
PYTEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(2 * len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2 * (os.cpu_count() or 1))')
pytest: $(STAMP) chromium postgres15 pgbouncer promtool
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

# The property tests with thousands of examples each, and schemathesis with hundreds per operation
# against a real gateway (`make test` runs a few): long (about half an hour here), not for CI. Prints the
# examples each property tried and the cases per operation.
FUZZ_TESTS := tests/test_jsonbody.py tests/test_fingerprint.py tests/test_keys.py tests/test_outbound.py \
	tests/test_wire.py tests/test_openapi.py tests/test_schemathesis.py tests/test_input_cost.py \
	tests/test_legible.py tests/test_mcp_inputs.py
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q --hypothesis-show-statistics $(FUZZ_TESTS)

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

# tests/test_failover.py runs a primary and a standby of Debian's Postgres 15. CI runs as root on Debian,
# so it is installed here when missing, without the cluster the package would otherwise make and start
# (every test stops what it started: CI leaves no server running).
PG15 := /usr/lib/postgresql/15/bin/postgres
postgres15:
	@if [ -x $(PG15) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's postgresql-15 for the failover tests"; \
		mkdir -p /etc/postgresql-common; \
		grep -qs '^create_main_cluster' /etc/postgresql-common/createcluster.conf || \
			echo 'create_main_cluster = false' >> /etc/postgresql-common/createcluster.conf; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql-15 >/dev/null; \
	else \
		echo "$(PG15) is missing and cannot be installed here (needs root and apt-get):" \
			"tests/test_failover.py will fail; install Debian's postgresql-15"; \
	fi

# Installs Debian's package $(1) as root, when $(2) is missing, with its service kept from starting
# (policy-rc.d says no to every start during the install: CI leaves no server running); anywhere else
# it says what is missing, and $(3) will fail with the same reason.
define debian_package
	@if [ -x $(2) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's $(1) for $(3)"; \
		guard=; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
			chmod +x /usr/sbin/policy-rc.d; guard=1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(1) >/dev/null; \
		status=$$?; [ -z "$$guard" ] || rm -f /usr/sbin/policy-rc.d; exit $$status; \
	else \
		echo "$(2) is missing and cannot be installed here (needs root and apt-get):" \
			"$(3) will fail; install Debian's $(1)"; \
	fi
endef

# tests/test_poolers.py runs the gateway behind Debian's PgBouncer.
PGBOUNCER := /usr/sbin/pgbouncer
pgbouncer:
	$(call debian_package,pgbouncer,$(PGBOUNCER),tests/test_poolers.py)

# tests/test_deploy.py checks the alert rules of deploy/prometheus with promtool, from Debian's
# prometheus package.
PROMTOOL := /usr/bin/promtool
promtool:
	$(call debian_package,prometheus,$(PROMTOOL),the alert rules' tests in tests/test_deploy.py)

# The whole suite with every in-process gateway behind PgBouncer in transaction mode (tests.poolers).
test-pgbouncer: $(STAMP) chromium postgres15 pgbouncer promtool
	TEST_POOLER=pgbouncer $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

# Failover under load, the long form: several failovers, many agents (make test runs one, with 40).
failover: $(STAMP) postgres15
	FAILOVERS=$(or $(FAILOVERS),5) AGENTS=$(or $(AGENTS),300) $(BIN)/pytest -q -s -p no:randomly tests/test_failover.py

# The deterministic simulator (sim/README.md): the real EffectService against simulated parts, for
# SIM_SECONDS across fresh seeds, then the exhaustive model check (model/README.md); non-zero on any
# violation, printing the failing seed and its shrunk schedule, or the model's counterexample trail.
SIM_SECONDS ?= 180
simulate: $(STAMP) spin
	$(BIN)/python -m sim run --seconds $(SIM_SECONDS)
	$(PYTHON) model/check.py


# The main job: the crash matrix of the reference article, on the embedded Postgres, with real SIGKILLs.
demo: $(STAMP)
	$(BIN)/effect-gateway demo

# The gateway with examples/gateway.toml on the embedded Postgres, in front of the demo upstreams.
serve: $(STAMP)
	$(BIN)/python -m agent_example.playground

bench: $(STAMP)
	$(BIN)/python -m bench.gateway_overhead
	$(BIN)/python -m bench.journal_step

# This tree's gateway beside another commit's (REF), each with its own venv, in turns: CPU, WAL and
# flushes per new effect and per replay, the p50 a new effect adds, new effects a second at 16 and 64.
bench-against: $(STAMP)
	@test -n "$(REF)" || { echo "usage: make bench-against REF=<commit>"; exit 2; }
	$(BIN)/python -m bench.against $(REF)

# The gateway under load from outside its process (wrk, else bench.loadgen), beside a direct upstream
# and a pass-through proxy: `make bench-load WORKERS=1,N DURATION=10 REPEAT=3`. About 8 minutes per
# workers setting. PROFILE=dir adds py-spy profiles of the gateway at c=64 (needs py-spy in .venv).
WORKERS ?= 1
DURATION ?= 10
REPEAT ?= 3
PROFILE ?=
# An MCP tool call straight to the server and through the gateway (a new effect, a replay, a ping passed on).
bench-mcp: $(STAMP)
	$(BIN)/python -m bench.mcp_call

bench-load: $(STAMP)
	$(BIN)/python -m bench.gateway_load --workers $(WORKERS) --duration $(DURATION) --repeat $(REPEAT) \
		$(if $(PROFILE),--profile $(PROFILE))

# The gateway as its effects table grows: `make bench-growth ROWS=10000000`. About 35 minutes at 1M.
ROWS ?= 1000000
bench-growth: $(STAMP)
	$(BIN)/python -m bench.growth --rows $(ROWS)

# Each worker's resident memory as new effects pile up: `make bench-memory EFFECTS=1000000` (about 20
# minutes at 1M on 2 cores).
EFFECTS ?= 1000000
bench-memory: $(STAMP)
	$(BIN)/python -m bench.worker_memory --effects $(EFFECTS)

# What reading agent input costs per byte at 16 KiB and 1 MiB, for shapes made to be slow (a few
# minutes; a shape over the limit per cell prints as such): `make bench-input INPUT_REPEAT=30`.
INPUT_REPEAT ?= 30
bench-input: $(STAMP)
	$(BIN)/python -m bench.input_cost --repeat $(INPUT_REPEAT)

clean:
	rm -rf $(VENV) .bench .effect-gateway examples/.effect-gateway .journal .pytest_cache .mypy_cache .ruff_cache
