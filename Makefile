# `make test` is the README's test command: it creates .venv and installs the project; the
# suite starts a PostgreSQL cluster and a RabbitMQ node of its own (tests/services.py) and
# leaves the machine's alone. `make demo` uses the machine's services (.ci/services starts
# them when down); `make bench` runs on a fresh pair with pg_stat_statements preloaded.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv services tools test demo lint bench mutate

venv: $(STAMP)

# Reinstall whenever pyproject.toml changes (new dependencies, entry points).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,airflow]'
	touch $@

services:
	.ci/services

# promtool for the alert/dashboard PromQL checks (unpacked into .tools/; never fails).
tools:
	.ci/tools

test: venv tools
	$(BIN)/pytest -q $(PYTEST_ARGS)

demo: venv services
	$(BIN)/triggerflow demo

lint: venv
	$(BIN)/ruff check
	$(BIN)/mypy triggerflow
	$(BIN)/lint-imports

bench: venv
	$(BIN)/python -m tests.services -- $(BIN)/triggerflow bench $(BENCH_ARGS)

# SQL mutation testing (docs/testing.md): deletes one condition at a time from the fencing,
# queue, take-over, quarantine and apply statements and runs the contract suite against it.
# CPU-heavy and long; not part of `make test`. The table goes to .tools/mutation-report.md.
mutate: venv
	nice $(BIN)/python -m tools.mutate_sql $(MUTATE_ARGS)
