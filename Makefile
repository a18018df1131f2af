# `make test` is the README's test command: it creates .venv, installs the project and
# starts local PostgreSQL and RabbitMQ (.ci/services) when needed.
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv services test demo lint bench

venv: $(STAMP)

# Reinstall whenever pyproject.toml changes (new dependencies, entry points).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -e '.[dev,airflow]'
	touch $@

services:
	.ci/services

test: venv services
	$(BIN)/pytest -q $(PYTEST_ARGS)

demo: venv services
	$(BIN)/triggerflow demo

lint: venv
	$(BIN)/ruff check
	$(BIN)/mypy triggerflow

bench: venv services
	$(BIN)/triggerflow bench
