"""Fixtures against real PostgreSQL and RabbitMQ: the session's own cluster and node
(testbed/services.py; never the machine's), a database and a broker namespace per test (so
tests never see each other's rows or queues), and real CLI processes.

``TRIGGERFLOW_TEST_PG`` / ``TRIGGERFLOW_TEST_AMQP`` / ``TRIGGERFLOW_TEST_MANAGEMENT`` (server
URLs) mean "use these instead"; the tests that restart a service then skip."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from testbed.broker import delete_topology
from testbed.services import RabbitNode, Services, start_services
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, upgrade_schema
from triggerflow.supervise import Supervisor, child_env
from triggerflow.transport.management import default_management_url
from triggerflow.transport.rabbitmq import RabbitTransport, Topology

ROOT = Path(__file__).resolve().parents[1]
# One template per test session, so suites sharing an overridden server (TRIGGERFLOW_TEST_PG)
# never drop each other's template mid-run.
TEMPLATE = f"triggerflow_test_template_{os.getpid()}"


@dataclass
class SuiteServices:
    """Where the session's services are. ``own`` holds the ones the suite started; a service
    given by an env override is not ours, and the tests that stop or restart it skip."""

    pg: str
    amqp: str
    management: str
    own: Services | None
    overridden: frozenset[str] = frozenset()  # "pg", "amqp"

    def owned(self, *kinds: str) -> Services:
        if self.own is None or self.overridden.intersection(kinds or ("pg", "amqp")):
            pytest.skip("restarts only services the suite started itself "
                        "(TRIGGERFLOW_TEST_PG/AMQP point elsewhere)")
        return self.own

    def restart_postgres(self) -> None:
        self.owned("pg").postgres.restart()

    def rabbit(self) -> RabbitNode:
        return self.owned("amqp").rabbit


@pytest.fixture(autouse=True)
def triggerflow_loggers_enabled() -> None:
    """A library's logging set-up run in-process by an earlier test (``dictConfig`` with its
    default ``disable_existing_loggers``) disables every logger that existed then,
    triggerflow's included: a later test reading a log line with ``caplog`` saw nothing (the
    in-process run, ``pytest -m inprocess``, failed in test_reaper_units without this)."""
    import logging

    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith("triggerflow") and isinstance(logger, logging.Logger):
            logger.disabled = False


@contextlib.contextmanager
def one_boot_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under ``pytest -n`` each worker starts services of its own (``make test``). Three
    RabbitMQ nodes booting side by side on a loaded 2-core machine each missed their
    deadline (load average 45); the workers of one run boot theirs one after another. The
    lock lives in the run's shared temporary directory (the workers' parent)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "services-boot.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SuiteServices]:
    pg = os.environ.get("TRIGGERFLOW_TEST_PG")
    amqp = os.environ.get("TRIGGERFLOW_TEST_AMQP")
    management = os.environ.get("TRIGGERFLOW_TEST_MANAGEMENT")
    overridden = frozenset(k for k, v in (("pg", pg), ("amqp", amqp)) if v)
    if pg and amqp:
        yield SuiteServices(pg, amqp, management or default_management_url(amqp), None,
                            overridden)
        return
    with one_boot_at_a_time(tmp_path_factory):
        own = start_services()
    try:
        yield SuiteServices(pg or own.postgres.url, amqp or own.rabbit.url,
                            management or (default_management_url(amqp) if amqp
                                          else own.rabbit.management_url), own, overridden)
    finally:
        own.stop()


@pytest.fixture(scope="session")
def pg_server(services: SuiteServices) -> str:
    """PostgreSQL server URL without a database."""
    return services.pg


@pytest.fixture(scope="session")
def amqp_server(services: SuiteServices) -> str:
    return services.amqp


async def admin_sql(pg: str, *statements: str) -> None:
    """Run statements on the maintenance database of server ``pg`` (CREATE / DROP DATABASE)."""
    conn = await asyncpg.connect(f"{pg}/postgres")
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def drop_database_sql(name: str) -> str:
    return f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    asyncio.run(admin_sql(pg_server, drop_database_sql(TEMPLATE), f'CREATE DATABASE "{TEMPLATE}"'))
    upgrade_schema(f"{pg_server}/{TEMPLATE}")
    yield TEMPLATE
    asyncio.run(admin_sql(pg_server, drop_database_sql(TEMPLATE)))


@pytest.fixture
async def dsn(template_db: str, pg_server: str) -> AsyncIterator[str]:
    name = f"tf_{uuid.uuid4().hex[:12]}"
    await admin_sql(pg_server, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield f"{pg_server}/{name}"
    await admin_sql(pg_server, drop_database_sql(name))


@pytest.fixture
def namespace() -> str:
    return f"tft{uuid.uuid4().hex[:10]}"


@pytest.fixture
def teams(namespace: str) -> list[str]:
    return [f"{namespace}-ml", f"{namespace}-data-eng"]


FAST = {
    "lease_ttl": 2.0,
    "renew_interval": 0.5,
    "reaper_interval": 1.0,
    "unclaimed_grace": 3.0,
    "cancel_sweep_interval": 1.0,
    "subscription_check_interval": 1.0,
    "subscription_renew_interval": 2.0,
    "probation_seconds": 0.5,
    # No hold after a deferral: rows written by tests have no worker exit for Airflow's
    # scheduler to see (tests/test_airflow_race.py tests the hold on the real stack).
    "airflow_resume_delay": 0.0,
}


@pytest.fixture
def settings(dsn: str, namespace: str, teams: list[str], services: SuiteServices) -> Settings:
    return Settings(
        database_url=dsn,
        amqp_url=services.amqp,
        management_url=services.management,
        namespace=namespace,
        allowed_modules=["triggerflow.triggers", "tests.triggers"],
        **FAST,  # type: ignore[arg-type]
    )


@pytest.fixture
async def topology(settings: Settings, teams: list[str]) -> AsyncIterator[Topology]:
    topo = Topology(settings.namespace)
    broker = RabbitTransport(settings.amqp_dsn(), topo, name="test-topology")
    await broker.connect()
    await broker.declare(teams)
    await broker.close()
    yield topo
    await delete_topology(settings.amqp_dsn(), topo, teams)


@pytest.fixture
async def db(dsn: str) -> AsyncIterator[Database]:
    database = await Database.connect(dsn, max_size=4)
    yield database
    await database.close()


@pytest.fixture
async def client(settings: Settings, topology: Topology) -> AsyncIterator[TriggerflowClient]:
    c = TriggerflowClient(settings)
    yield c
    await c.close()


def settings_env(settings: Settings, **overrides: Any) -> dict[str, str]:
    """The environment that gives a CLI subprocess exactly these settings."""
    return child_env(settings, pythonpath=str(ROOT), **overrides)


class Processes:
    """Starts real ``triggerflow`` CLI processes; kills whatever is left at teardown."""

    def __init__(self, settings: Settings, logdir: Path) -> None:
        self.settings = settings
        self.supervisor = Supervisor(logdir, cwd=ROOT)

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        return self.supervisor.children

    def start(self, *args: str, extra_pythonpath: str | None = None,
              **overrides: Any) -> subprocess.Popen[bytes]:
        env = settings_env(self.settings, **overrides)
        if extra_pythonpath:
            env["PYTHONPATH"] = f"{extra_pythonpath}{os.pathsep}{env['PYTHONPATH']}"
        return self.supervisor.start(*args, env=env)

    def consume(self, *queues: str, **overrides: Any) -> subprocess.Popen[bytes]:
        args = ["consume"]
        for q in queues:
            args += ["--queue", q]
        return self.start(*args, **overrides)

    def writer(self, **overrides: Any) -> subprocess.Popen[bytes]:
        return self.start("writer", **overrides)

    def log(self, proc: subprocess.Popen[bytes]) -> str:
        return self.supervisor.log(proc)

    def stop_all(self) -> None:
        self.supervisor.stop_all(sig=signal.SIGKILL, grace=10)


# The contract suite's stores reach their databases through ``request.getfixturevalue``, which
# the fixture closure does not show: these parameters need the services all the same.
SERVICE_PARAMS = {"store_kind": ("postgres", "airflow")}


def uses_services(item: pytest.Item) -> bool:
    if "services" in getattr(item, "fixturenames", ()):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(params.get(name) in values for name, values in SERVICE_PARAMS.items())


def has_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d and d[-1].scope == "module" for d in defs)


def xdist_group(item: pytest.Item) -> str | None:
    """The worker group of a test under ``pytest -n N --dist loadgroup`` (``make test``).
    Each worker is a session of its own, with its own PostgreSQL and RabbitMQ (``services``
    is session-scoped), so a test that restarts them disturbs only its worker. Grouped: a
    module whose module-scoped fixture (a chaos run, a rendered chart, a 3-node cluster)
    would otherwise be set up on every worker. The tests on an Airflow template database are
    not: a stage of nothing else (``make test-airflow-3.2``) would run on one worker."""
    if has_module_fixture(item):
        return item.nodeid.split("::", 1)[0]
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that use no service (no ``services`` fixture, however indirect):
    ``make check`` runs them alone, in seconds. Before the contract suite's PostgreSQL and
    Airflow cases were recognised here, ``-m inprocess`` started the services for them."""
    for item in items:
        if not uses_services(item):
            item.add_marker(pytest.mark.inprocess)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
            if config.getoption("loadgroup", False):
                _name_group(item, group)


def _name_group(item: pytest.Item, group: str) -> None:
    """What ``--dist loadgroup`` schedules by: the group after an ``@`` in the test's id.
    pytest-xdist 3.8 writes it to ``Item._nodeid``, which pytest 9 no longer reads (the id
    is ``Item._id``), so every group was split across the workers; written here in the form
    this pytest reads. The scheduler groups by id alone, so the test's own run is unchanged."""
    if hasattr(item, "_id"):  # pytest 9 (pytest 8's ``_nodeid`` is xdist's own to write)
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


CALL_FAILED = pytest.StashKey[bool]()  # set per test by the hook below, read by ``procs``


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[CALL_FAILED] = report.failed
    return report


@pytest.fixture
def procs(request: pytest.FixtureRequest, settings: Settings, topology: Topology,
          tmp_path: Path) -> Iterator[Processes]:
    p = Processes(settings, tmp_path)
    yield p
    p.stop_all()
    # A failed test shows what its processes logged (a CI run leaves nothing else behind).
    if os.environ.get("TRIGGERFLOW_TEST_SHOW_LOGS") or request.node.stash.get(CALL_FAILED, False):
        for proc in p.procs:
            sys.stderr.write(f"----- {' '.join(map(str, proc.args))[-120:]} (rc {proc.returncode})\n")
            sys.stderr.write(p.log(proc)[-20000:])


# How long a test waits for a CLI process it started to register (its start-up: imports, the
# first connections). A readiness wait, not a bound under test: it returns as soon as the row
# appears. 15 s ran out under `make test`'s workers on a machine at load average 20-30.
START_WAIT = 60.0


class Counted:
    """Stands in for the metrics (``get_metrics()``): every ``<counter>.add(n, labels)``."""

    def __init__(self) -> None:
        self.adds: list[tuple[str, int, dict[str, str] | None]] = []

    def __getattr__(self, counter: str) -> Any:
        class Counter:
            @staticmethod
            def add(n: int, labels: dict[str, str] | None = None) -> None:
                self.adds.append((counter, n, labels))
        return Counter()


async def wait_until(
    check: Callable[[], Awaitable[Any]], timeout: float, interval: float = 0.1,
    message: str = "condition",
) -> Any:
    """Poll ``check`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"{message} not reached within {timeout}s (last: {last!r})")


async def consumer_id(db: Database, proc: subprocess.Popen[bytes]) -> int:
    """The id a started consumer registered under (a loaded machine starts one slowly)."""
    async def find() -> int | None:
        return await db.fetchval(  # type: ignore[no-any-return]
            "SELECT max(id) FROM consumer WHERE pid = $1 AND kind = 'consumer' "
            "AND expires_at > now()", proc.pid)

    return int(await wait_until(find, START_WAIT, message=f"consumer pid {proc.pid} registered"))


async def states(db: Database) -> dict[str, int]:
    rows = await db.fetch("SELECT coalesce(state, 'none') AS s, count(*) AS n FROM task_instance "
                          "GROUP BY 1")
    return {r["s"]: r["n"] for r in rows}
