# `make test` is the README's test command: it creates .venv and installs the project; the
# suite starts a PostgreSQL cluster and a RabbitMQ node of its own (tests/services.py) and
# leaves the machine's alone. `make demo` uses the machine's services (.ci/services starts
# them when down); `make bench` runs on a fresh pair with pg_stat_statements preloaded.
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the package alone; the suite adds the dev tools and Airflow (for Airflow
# mode's tests): 95 more distributions the demo never imports.
STAMP_RUN := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

.PHONY: venv services tools test check demo lint bench mutate mutate-py

venv: $(STAMP)

# Reinstall whenever pyproject.toml changes (new dependencies, entry points).
$(STAMP_RUN): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e .
	touch $@

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,airflow]'
	touch $@ $(STAMP_RUN)

services:
	.ci/services

# promtool for the alert/dashboard PromQL checks (unpacked into .tools/; never fails).
tools:
	.ci/tools

test: venv tools
	$(BIN)/pytest -q $(PYTEST_ARGS)

demo: $(STAMP_RUN) services
	$(BIN)/triggerflow demo

lint: venv
	$(BIN)/ruff check
	$(BIN)/mypy
	$(BIN)/lint-imports

# Everyday work: lint, types, import contracts and the tests that need no service.
check: lint
	$(BIN)/pytest -q -m inprocess

bench: venv
	$(BIN)/python -m tests.services -- $(BIN)/triggerflow bench $(BENCH_ARGS)

# SQL mutation testing (docs/testing.md): deletes one condition at a time from the fencing,
# queue, take-over, quarantine and apply statements and runs the contract suite against it.
# CPU-heavy and long; not part of `make test`. The table goes to .tools/mutation-report.md.
mutate: venv
	nice $(BIN)/python -m tools.mutate_sql $(MUTATE_ARGS)

# Python mutation testing (docs/testing.md): mutmut over the lease, probation, rebalance,
# reaper, writer and wire modules ([tool.mutmut] in pyproject.toml), each mutant against the
# in-process tests that reach it. Not part of `make test`; results are kept in mutants/ and
# the survivors' diffs go to .tools/mutation-py-report.md.
mutate-py: venv
	nice $(BIN)/python -m tools.mutate_py $(MUTATE_PY_ARGS)
