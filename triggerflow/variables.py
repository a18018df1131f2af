"""Which ``TRIGGERFLOW_*`` environment variables exist, so that a misspelt one is refused, not
ignored: a typo ignored runs on a default. The refusal names the closest real name.

A variable is known when it is a setting's (``Settings.env_name``), a CLI option's that is no
setting (:data:`COMMAND_OPTIONS`), or one read outside both (:data:`READ_ELSEWHERE`).
Imports nothing of ours but the errors, so the settings and the CLI both use it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from triggerflow.errors import ConfigurationError

PREFIX = "TRIGGERFLOW_"

# The variables of the CLI's own options (``TRIGGERFLOW_<COMMAND>_<OPTION>``, given by
# ``cli.commands.give_env_vars``, or named in the option). Here, not read from the CLI, so the
# SDK knows them without importing it; tests/test_config_typos.py checks this list against
# the options of every command.
COMMAND_OPTIONS = frozenset({
    "TRIGGERFLOW_BENCH_MINUTES", "TRIGGERFLOW_BENCH_MODE", "TRIGGERFLOW_BENCH_QUICK",
    "TRIGGERFLOW_BENCH_REPEATS", "TRIGGERFLOW_BENCH_SEED", "TRIGGERFLOW_BENCH_TOPOLOGY",
    "TRIGGERFLOW_BENCH_ZONE_TRIGGERS",
    "TRIGGERFLOW_CANCEL_STATE", "TRIGGERFLOW_DB_UPGRADE_REVISION", "TRIGGERFLOW_DEFER_BATCH",
    "TRIGGERFLOW_DEFER_COUNT", "TRIGGERFLOW_DEFER_DAG_ID", "TRIGGERFLOW_DEFER_KWARGS",
    "TRIGGERFLOW_DEFER_QUEUE", "TRIGGERFLOW_DEFER_TIMEOUT", "TRIGGERFLOW_DEFER_TRIGGER",
    "TRIGGERFLOW_DELIVERY_LIMIT", "TRIGGERFLOW_DEMO_KEEP_RUNNING", "TRIGGERFLOW_DEMO_TASKS",
    "TRIGGERFLOW_DOCS_CONFIG_OUTPUT", "TRIGGERFLOW_DOCS_MODULES_PAGE", "TRIGGERFLOW_HEALTH_KIND",
    "TRIGGERFLOW_HEALTH_LIVE", "TRIGGERFLOW_HEALTH_PID", "TRIGGERFLOW_REQUEUE_FORCE",
    "TRIGGERFLOW_STATUS_IDS", "TRIGGERFLOW_STATUS_JSON", "TRIGGERFLOW_TRIGGER_SHOW_JSON",
})

# Read by something other than Settings and the CLI's options; each names its reader. They
# reach triggerflow's processes too (a developer's shell, the test suite's children), so they
# must not be refused there.
READ_ELSEWHERE: dict[str, str] = {
    "TRIGGERFLOW_TEST_PG": "tests/conftest.py: an existing PostgreSQL for the suite",
    "TRIGGERFLOW_TEST_AMQP": "tests/conftest.py: an existing RabbitMQ for the suite",
    "TRIGGERFLOW_TEST_MANAGEMENT": "tests/conftest.py: that RabbitMQ's management API",
    "TRIGGERFLOW_TEST_SERVICES_DIR": "testbed/services.py: where the suite's servers live",
    "TRIGGERFLOW_TEST_SHOW_LOGS": "tests/conftest.py, tests/test_airflow_migration.py: "
                                  "print the processes' logs",
    "TRIGGERFLOW_TEST_KEEP_AIRFLOW_HOME": "tests/airflow_support.py: keep the Airflow stack's "
                                          "home",
    "TRIGGERFLOW_FAILOVER_REPS": "tests/test_stuck_faults.py: repetitions of the failover test",
    "TRIGGERFLOW_FAILOVER_LEAD": "tests/test_stuck_faults.py: start lead of the failover test",
    "TRIGGERFLOW_BENCH_LATENESS_LEAD": "bench/lateness.py (`triggerflow bench`): claim lead",
    "TRIGGERFLOW_PG_CLUSTER": ".ci/services: the CI machine's PostgreSQL cluster",
    "TRIGGERFLOW_TEST_MODEL_SEED": "tests/contract/test_model.py, tests/test_codec_properties.py: "
                                   "draw other sequences than the fixed ones",
}


class UnknownSetting(ConfigurationError):
    """A ``TRIGGERFLOW_*`` variable, or a keyword of ``Settings(...)``, that names no setting."""


def closest(name: str, known: Iterable[str], prefix: str = "") -> str | None:
    """The known name ``name`` most likely misspells, or None. Compared without ``prefix``:
    the shared ``TRIGGERFLOW_`` would make every name look alike."""
    import difflib  # only on the error path

    stems = {k.removeprefix(prefix): k for k in known}
    found = difflib.get_close_matches(name.removeprefix(prefix), list(stems), n=1, cutoff=0.6)
    return stems[found[0]] if found else None


def refusal(names: Iterable[str], known: Collection[str], prefix: str = "") -> str | None:
    """One line naming each of ``names`` that is not ``known``, with its closest known name;
    None when all are known."""
    parts = []
    for name in sorted(set(names) - set(known)):
        guess = closest(name, known, prefix)
        hint = f"did you mean {guess}?" if guess else "see docs/configuration.md"
        parts.append(f"{name} is not a triggerflow setting; {hint}")
    return "; ".join(parts) or None


def unknown_variables(environ: Iterable[str], settings_variables: Collection[str]) -> str | None:
    """The refusal of the ``TRIGGERFLOW_*`` names in ``environ`` that are unknown, or None."""
    ours = [name for name in environ if name.startswith(PREFIX)]
    if not ours:
        return None
    known = {*settings_variables, *COMMAND_OPTIONS, *READ_ELSEWHERE}
    return refusal(ours, known, PREFIX)
