"""Fixtures against real PostgreSQL and RabbitMQ: the session's own cluster and node
(tests/services.py; never the machine's), a database and a broker namespace per test (so
tests never see each other's rows or queues), and real CLI processes.

``TRIGGERFLOW_TEST_PG`` / ``TRIGGERFLOW_TEST_AMQP`` / ``TRIGGERFLOW_TEST_MANAGEMENT`` (server
URLs) mean "use these instead"; the tests that restart a service then skip."""

from __future__ import annotations

import asyncio
import contextlib
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

import aio_pika
import asyncpg
import pytest

from tests.services import RabbitNode, Services, start_services
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


@pytest.fixture(scope="session")
def services() -> Iterator[SuiteServices]:
    pg = os.environ.get("TRIGGERFLOW_TEST_PG")
    amqp = os.environ.get("TRIGGERFLOW_TEST_AMQP")
    management = os.environ.get("TRIGGERFLOW_TEST_MANAGEMENT")
    overridden = frozenset(k for k, v in (("pg", pg), ("amqp", amqp)) if v)
    if pg and amqp:
        yield SuiteServices(pg, amqp, management or default_management_url(amqp), None,
                            overridden)
        return
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


async def delete_topology(amqp_dsn: str, topo: Topology, queues: list[str]) -> None:
    """Delete everything a test's namespace declared: its team queues, shared queues and
    exchanges. A failed delete closes its channel, so each gets a channel of its own."""
    conn = await aio_pika.connect(amqp_dsn)
    try:
        deletions = [("queue_delete", q) for q in (*queues, topo.events_queue, topo.dead_queue)]
        deletions += [("exchange_delete", x) for x in topo.exchanges()]
        deletions += [("exchange_delete", x) for q in queues for x in topo.team_exchanges(q)]
        for method, name in deletions:
            ch = await conn.channel()
            with contextlib.suppress(Exception):
                await getattr(ch, method)(name)
            if not ch.is_closed:
                await ch.close()
    finally:
        await conn.close()


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that use no service (no ``services`` fixture, however indirect):
    ``make check`` runs them alone, in seconds."""
    for item in items:
        if "services" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.inprocess)


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


async def states(db: Database) -> dict[str, int]:
    rows = await db.fetch("SELECT coalesce(state, 'none') AS s, count(*) AS n FROM task_instance "
                          "GROUP BY 1")
    return {r["s"]: r["n"] for r in rows}
