# `make test` is the README's test command: it creates .venv and installs the project; the
# suite starts PostgreSQL clusters and RabbitMQ nodes of its own (testbed/services.py) and
# leaves the machine's alone. `make test-airflow` runs the Airflow stack tests. `make demo` uses the machine's services (.ci/services starts
# them when down); `make bench` runs on a fresh pair with pg_stat_statements preloaded.
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the package alone; the suite adds the dev tools, Airflow (for Airflow
# mode's tests) and MkDocs (tests/test_docs.py builds the site): distributions the demo never imports.
STAMP_RUN := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

.PHONY: venv services tools test test-airflow check demo lint bench mutate mutate-py test-airflow-version test-airflow-3.2

venv: $(STAMP)

# Reinstall whenever pyproject.toml changes (new dependencies, entry points).
$(STAMP_RUN): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e .
	touch $@

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,airflow,docs]'
	touch $@ $(STAMP_RUN)

services:
	.ci/services

# promtool for the alert/dashboard PromQL checks (unpacked into .tools/; never fails).
tools:
	.ci/tools

# The suite in stages (docs/testing.md). `make test`: everything but the Airflow stacks, first
# spread over TEST_WORKERS processes (each starts a PostgreSQL and a RabbitMQ of its own, so a
# test that restarts them disturbs no other worker), then the tests that assert a timing bound
# (marked `serial`) one at a time. `make test-airflow`: the tests that start a real Airflow
# stack, one at a time. .ci/run runs both. A stage that PYTEST_ARGS leaves empty (pytest's
# exit status 5) is not a failure.
TEST_WORKERS ?= 2
CHECK_WORKERS ?= 2
PYTEST := $(BIN)/pytest -q
stage = { $(1) || { rc=$$?; [ $$rc -eq 5 ] || status=$$rc; }; }

test: venv tools
	@status=0; \
	$(call stage,$(PYTEST) --durations=15 -n $(TEST_WORKERS) --dist loadgroup -m "not serial and not airflow_stack" $(PYTEST_ARGS)); \
	$(call stage,$(PYTEST) --durations=10 -m "serial and not airflow_stack" $(PYTEST_ARGS)); \
	exit $$status

test-airflow: venv tools
	@status=0; \
	$(call stage,$(PYTEST) --durations=10 -m airflow_stack $(PYTEST_ARGS)); \
	exit $$status

demo: $(STAMP_RUN) services
	$(BIN)/triggerflow demo

lint: venv
	$(BIN)/ruff check
	$(BIN)/mypy
	$(BIN)/lint-imports

# Everyday work: lint, types, import contracts and the tests that need no service.
check: lint
	@status=0; \
	$(call stage,$(PYTEST) -n $(CHECK_WORKERS) -m "inprocess and not serial" $(PYTEST_ARGS)); \
	$(call stage,$(PYTEST) -m "inprocess and serial" $(PYTEST_ARGS)); \
	exit $$status

bench: venv
	$(BIN)/python -m testbed.services -- $(BIN)/triggerflow bench $(BENCH_ARGS)

# SQL mutation testing (docs/testing.md): deletes one condition at a time from the fencing,
# queue, take-over, quarantine and apply statements and runs the contract suite against it.
# CPU-heavy and long; not part of `make test`. The table goes to .tools/mutation-report.md.
mutate: venv
	nice $(BIN)/python -m tools.mutate_sql $(MUTATE_ARGS)

# Python mutation testing (docs/testing.md): mutmut over the lease, probation, doubts,
# rebalance, reaper, writer and wire modules ([tool.mutmut] in pyproject.toml), each mutant against the
# in-process tests that reach it. Not part of `make test`; results are kept in mutants/ and
# the survivors' diffs go to .tools/mutation-py-report.md.
mutate-py: venv
	nice $(BIN)/python -m tools.mutate_py $(MUTATE_PY_ARGS)

# The Airflow e2e tests against another Airflow release, in a venv of its own
# (.venv-airflow-<version>): `make test-airflow-version AIRFLOW_VERSION=3.2.2`. The stack's
# processes (scheduler, API server, dag-processor, `airflow triggerer`) are that release's;
# triggerflow refuses a schema revision it was not checked against (docs/airflow-reference.md,
# "Supported versions": 3.2 and 3.3).
AIRFLOW_VERSION ?= 3.3.2
STANDARD_PROVIDER ?= 1.21.0
AF_VENV := .venv-airflow-$(AIRFLOW_VERSION)
# Airflow 3.2's API server does not start with the newest cadwyn/fastapi pip picks today
# (cadwyn 9.0.0, fastapi 0.165.0: "Model 'TITerminalStatePayload' needs a discriminator
# field"); pinned to the releases Airflow 3.3.2 resolves here.
AIRFLOW_PINS ?= $(if $(filter 3.2.%,$(AIRFLOW_VERSION)),'cadwyn==7.0.0' 'fastapi==0.136.3' 'pydantic==2.14.4')
AIRFLOW_TESTS ?= tests/test_airflow_e2e.py

$(AF_VENV)/.installed: pyproject.toml
	test -x $(AF_VENV)/bin/python || python3 -m venv $(AF_VENV)
	$(AF_VENV)/bin/pip install 'apache-airflow==$(AIRFLOW_VERSION)' \
		'apache-airflow-providers-standard==$(STANDARD_PROVIDER)' 'psycopg2-binary>=2.9' \
		'apache-airflow-providers-http==6.3.0' $(AIRFLOW_PINS)
	$(AF_VENV)/bin/pip install -e '.[dev]'
	$(AF_VENV)/bin/pip check
	touch $@

test-airflow-version: $(AF_VENV)/.installed
	PATH=$(CURDIR)/$(AF_VENV)/bin:$$PATH $(AF_VENV)/bin/pytest -q $(AIRFLOW_TESTS) $(PYTEST_ARGS)

# The second Airflow minor .ci/run tests (docs/airflow-reference.md, "Supported versions"): with Airflow
# 3.2.2's code and schema, every in-process test of Airflow mode (those of 3.3-only features skip),
# in the stages of `make test`, then the real-stack modules whose path differs between the
# releases (each case under Airflow's triggerer, then triggerflow, on the same DAGs): the rows
# an event writes (e2e), the scheduler race against 3.2's scheduler (race) and the task
# runtime (runtime_e2e). The rest read and write the same columns
# on both; their SQL runs on 3.2's schema in the in-process stage. More with
# AIRFLOW_3_2_STACK="... tests/test_airflow_ops_e2e.py tests/test_airflow_assets.py".
AF32 = $(MAKE) --no-print-directory test-airflow-version AIRFLOW_VERSION=3.2.2
# The in-process Airflow tests, less those that run no Airflow code and read no Airflow schema
# (the Helm chart's airflow values, the bench's tables, import layering): they pass or fail
# alike on either release.
AF32_SAME = airflow and not test_helm and not test_bench_ and not test_layers
AIRFLOW_3_2_STACK ?= tests/test_airflow_e2e.py tests/test_airflow_race.py \
	tests/test_airflow_runtime_e2e.py
test-airflow-3.2:
	@status=0; \
	$(call stage,$(AF32) AIRFLOW_TESTS="tests/ -k '$(AF32_SAME)' -n $(TEST_WORKERS) --dist loadgroup -m 'not serial and not airflow_stack'"); \
	$(call stage,$(AF32) AIRFLOW_TESTS="tests/ -k airflow -m 'serial and not airflow_stack'"); \
	$(call stage,$(AF32) AIRFLOW_TESTS="$(AIRFLOW_3_2_STACK)"); \
	exit $$status
