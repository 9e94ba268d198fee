# Two commands do all the set-up: `make run` (the whole stack + a demo fleet) and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

# Tests create their own databases and broker names; these only say where the servers are.
TEST_DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
TEST_AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/
# `make run` uses its own database.
DATABASE_URL ?= postgresql://postgres@127.0.0.1:5432/monitoring
AMQP_URL ?= amqp://guest:guest@127.0.0.1:5672/
export DATABASE_URL AMQP_URL

.PHONY: asyncapi install backends lint lint-contracts contracts test test-unit test-integration test-e2e test-deploy run observe migrate bench chaos faults faults-long faults-down soak reshard clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

backends:
	bash scripts/ensure-backends.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(MAKE) --no-print-directory lint-contracts

# The committed API documents (contracts/): @redocly/cli, the exact version contracts/package-lock.json pins
# (installed by the script on first use; ~2 s a run). `make contracts` regenerates them from the code.
REDOCLY := REDOCLY_TELEMETRY=off REDOCLY_SUPPRESS_UPDATE_NOTICE=true contracts/node_modules/.bin/redocly
lint-contracts:
	bash scripts/ensure-node-tools.sh
	$(REDOCLY) lint --config contracts/redocly.yaml --format=summary contracts/openapi/*.json

contracts: install
	$(BIN)/monitorctl contracts write

# Two pytest-xdist workers, a test file each at a time (TEST_WORKERS=0 runs serially): the tests isolate their
# databases, broker names and ports, and the ones that failed with two e2e files side by side wait on what they
# check, not on a loaded box's timing (test_legacy_path_e2e b and c; collect-now d through the TCP proxy; git log).
# The schemathesis tests run on their own, serially: their cases share one test id per API (one item per operation,
# the same name), and xdist reports such items once, so their failures could go unseen.
TEST_WORKERS ?= 2
SERIAL_TESTS := tests/e2e/test_contract_fuzz.py
test: install backends lint
	bash scripts/ensure-promtool.sh
	bash scripts/ensure-node-tools.sh
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile \
		--durations=25 $(foreach t,$(SERIAL_TESTS),--ignore=$(t))
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest $(SERIAL_TESTS)

test-unit: install
	$(BIN)/pytest tests/unit

test-integration: install backends
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest tests/integration

test-e2e: install backends
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest tests/e2e

# Every service process under its own Postgres role and RabbitMQ user (~10 s; needs root for rabbitmqctl):
# tests/deploy, also part of `make test`; this target runs it alone.
test-deploy: install backends
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest tests/deploy

migrate: install backends
	$(BIN)/monitorctl migrate

run: install backends migrate
	bash scripts/run-stack.sh

# Next to `make run` (start that one with OBSERVE=1 to send its traces here): a local Prometheus with the
# shipped alert rules on :9090 and the trace sink on :4318.
observe: install
	bash scripts/observe.sh

bench: install backends
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/python -m bench

# The service chaos test's long run (its quick one is part of `make test`): CHAOS_MINUTES of faults (15), then the
# invariants; CHAOS_SEED=N replays a run, CHAOS_REPORT=PATH keeps its report. docs/reliability.md.
CHAOS_MINUTES ?= 15
chaos: install backends
	CHAOS_MINUTES=$(CHAOS_MINUTES) DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) \
		$(BIN)/pytest -s tests/e2e/test_service_chaos.py

# Infrastructure faults on real processes (tests/faults, ~3 minutes; not in `make test`), with their figures printed:
# a leader whose node goes silent (iptables drops its cgroup's packets), Postgres stopped fast and immediate, the
# broker alarmed and stopped. They stop and alarm a private Postgres and RabbitMQ (scripts/fault-servers.sh, ports
# 5433 and 5673), never the shared ones, so they can run beside anything. docs/reliability.md.
FAULT_ENV = set -a && eval "$$(bash scripts/fault-servers.sh up)" && set +a && \
	DATABASE_URL=$$FAULT_DATABASE_URL AMQP_URL=$$FAULT_AMQP_URL
faults: install
	bash scripts/ensure-fault-tools.sh
	$(FAULT_ENV) $(BIN)/pytest -s tests/faults

# The same at the durations of docs/reliability.md's table (~25 minutes): Postgres away 75 s (fast and immediate),
# the broker alarmed 10 minutes and stopped 45 s, ingest's database away 6 minutes.
faults-long: install
	bash scripts/ensure-fault-tools.sh
	$(FAULT_ENV) FAULT_PG_OUTAGE_SECONDS=75 FAULT_ALARM_SECONDS=600 FAULT_BROKER_STOP_SECONDS=45 \
		INGEST_OUTAGE_SECONDS=360 $(BIN)/pytest -s tests/faults tests/integration/test_ingest_db_outage.py

# Stop the fault suite's private servers and remove their data.
faults-down:
	bash scripts/fault-servers.sh down

# The stack under steady work for SOAK_MINUTES (30), sampled every minute, with a growth verdict at the end.
SOAK_MINUTES ?= 30
soak: install backends
	SOAK_MINUTES=$(SOAK_MINUTES) DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/python -m bench.soak

# Online resharding of ingest under load (4 -> 8 -> 4 with real ingest workers; ~80 s): docs/reliability.md.
reshard: install backends
	DATABASE_URL=$(TEST_DATABASE_URL) AMQP_URL=$(TEST_AMQP_URL) $(BIN)/pytest -s tests/long

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The desktop protocol's AsyncAPI document, generated from the msgspec contracts (docs/desktop-protocol.md); a unit
# test fails while the committed one is stale, and validates it with @asyncapi/parser (contracts/).
asyncapi: install
	$(BIN)/python -m services.dispatch_hub.asyncapi
	bash scripts/ensure-node-tools.sh
	cd contracts && node validate-asyncapi.mjs asyncapi/desktop.json
