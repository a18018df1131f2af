"""Fixtures against the real PostgreSQL and RabbitMQ: a database and a broker namespace per
test (so tests never see each other's rows or queues), and real CLI processes."""

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
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg
import pytest

from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, upgrade_schema
from triggerflow.supervise import Supervisor, child_env
from triggerflow.transport.rabbitmq import RabbitTransport, Topology

ROOT = Path(__file__).resolve().parents[1]
PG = os.environ.get("TRIGGERFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
AMQP = os.environ.get("TRIGGERFLOW_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
# One template per test session, so engineers (and CI) running suites at once never drop
# each other's template mid-run.
TEMPLATE = f"triggerflow_test_template_{os.getpid()}"


async def admin_sql(*statements: str) -> None:
    """Run statements on the maintenance database (CREATE / DROP DATABASE)."""
    conn = await asyncpg.connect(f"{PG}/postgres")
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


def drop_database_sql(name: str) -> str:
    return f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    asyncio.run(admin_sql(drop_database_sql(TEMPLATE), f'CREATE DATABASE "{TEMPLATE}"'))
    upgrade_schema(f"{PG}/{TEMPLATE}")
    yield TEMPLATE
    asyncio.run(admin_sql(drop_database_sql(TEMPLATE)))


@pytest.fixture
async def dsn(template_db: str) -> AsyncIterator[str]:
    name = f"tf_{uuid.uuid4().hex[:12]}"
    await admin_sql(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield f"{PG}/{name}"
    await admin_sql(drop_database_sql(name))


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
}


@pytest.fixture
def settings(dsn: str, namespace: str, teams: list[str]) -> Settings:
    return Settings(
        database_url=dsn,
        amqp_url=AMQP,
        namespace=namespace,
        allowed_modules=["triggerflow.triggers", "triggerflow.examples", "tests.triggers"],
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
    # Clean up everything this namespace declared. A failed delete closes its channel, so
    # each gets a channel of its own.
    conn = await aio_pika.connect(settings.amqp_dsn())
    try:
        deletions = [("queue_delete", q) for q in (*teams, topo.events_queue, topo.dead_queue)]
        deletions += [("exchange_delete", x) for x in topo.exchanges()]
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


@pytest.fixture
def procs(settings: Settings, topology: Topology, tmp_path: Path) -> Iterator[Processes]:
    p = Processes(settings, tmp_path)
    yield p
    p.stop_all()
    if os.environ.get("TRIGGERFLOW_TEST_SHOW_LOGS"):
        for proc in p.procs:
            sys.stderr.write(p.log(proc))


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
