"""A real Airflow 3.3.2 metadata database for Airflow-mode tests.

``airflow db migrate`` runs once per test session into a template database on the suite's own
PostgreSQL server (fixture ``pg_server``); each test gets its own copy (``CREATE DATABASE …
TEMPLATE``). Airflow reads its configuration from the environment when first imported, so the
key and home are set here, at import, before any test module imports Airflow; the database URL
is only known once the session's server runs, and goes to the subprocesses that need it
(``airflow_env``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from testbed.airflow_stack import AirflowStack
from testbed.broker import delete_queues
from tests.conftest import FAST, admin_sql, drop_database_sql
from triggerflow.airflow.schema import installed_release

AIRFLOW_TEMPLATE = f"tf_airflow_template_{os.getpid()}"
# A fixed test key: rows encrypted by Airflow's code in a test decrypt with the same key.
FERNET_KEY = "P3vN2mJ6kq1pG7x0lS7fZ5t3d2QyYc8u9wAbCdEfGhI="
AIRFLOW_HOME = tempfile.mkdtemp(prefix="tf-airflow-home-")
atexit.register(shutil.rmtree, AIRFLOW_HOME, ignore_errors=True)
BIN = Path(sys.executable).parent
BASE_ENV = {
    "AIRFLOW_HOME": AIRFLOW_HOME,
    "AIRFLOW__CORE__FERNET_KEY": FERNET_KEY,
    "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
}


class _Server:
    """The suite's PostgreSQL server URL, set by ``airflow_template`` (session scope) so the
    helpers below keep taking a database name."""

    url: str | None = None

    @classmethod
    def get(cls) -> str:
        if cls.url is None:
            raise RuntimeError("no Airflow database yet: use the airflow_db fixture")
        return cls.url


def airflow_minor() -> str:
    """The Airflow minor installed here, "3.3" (``make test-airflow-version`` runs others)."""
    return installed_release()


# A feature Airflow 3.2 does not have (shared streams, the asset state store): its tests run
# on 3.3 only (docs/airflow-reference.md, "Supported versions").
airflow_3_3_only = pytest.mark.skipif(
    airflow_minor() == "3.2", reason="an Airflow 3.3 feature (3.2 has none)")


def airflow_env(database: str) -> dict[str, str]:
    return {**BASE_ENV, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(database)}


def sqlalchemy_url(database: str) -> str:
    return _Server.get().replace("postgresql://", "postgresql+psycopg2://", 1) + f"/{database}"


# Before anything imports Airflow (it reads its configuration once, at import).
os.environ.update(BASE_ENV)
pytest.importorskip("airflow", reason="needs triggerflow[airflow]")


@pytest.fixture(scope="session")
def airflow_template(pg_server: str) -> Iterator[str]:
    _Server.url = pg_server
    asyncio.run(admin_sql(pg_server, drop_database_sql(AIRFLOW_TEMPLATE),
                          f'CREATE DATABASE "{AIRFLOW_TEMPLATE}"'))
    subprocess.run([str(BIN / "airflow"), "db", "migrate"], check=True, capture_output=True,
                   env={**os.environ, **airflow_env(AIRFLOW_TEMPLATE)}, timeout=240)
    yield AIRFLOW_TEMPLATE
    asyncio.run(admin_sql(pg_server, drop_database_sql(AIRFLOW_TEMPLATE)))


@contextlib.contextmanager
def stack_database(stack: AirflowStack, template: str) -> Iterator[None]:
    """The stack's metadata database as a copy of the session's migrated template: what the
    stack's own ``airflow db migrate`` makes (same Airflow, same command), in a second instead
    of tens of seconds. Dropped afterwards; call ``stack.start()`` inside."""
    asyncio.run(admin_sql(stack.server_url,
                          f'CREATE DATABASE "{stack.database}" TEMPLATE "{template}"'))
    try:
        yield
    finally:
        stack.stop(keep_home=bool(os.environ.get("TRIGGERFLOW_TEST_KEEP_AIRFLOW_HOME")))
        asyncio.run(admin_sql(stack.server_url, drop_database_sql(stack.database)))


async def copy_database(source: str) -> str:
    name = f"tf_af_{uuid.uuid4().hex[:12]}"
    await admin_sql(_Server.get(), f'CREATE DATABASE "{name}" TEMPLATE "{source}"')
    return name


async def drop_database(name: str) -> None:
    await admin_sql(_Server.get(), drop_database_sql(name))


@pytest.fixture
async def airflow_db(airflow_template: str) -> AsyncIterator[str]:
    """Name of a fresh, migrated Airflow database (dropped afterwards)."""
    name = await copy_database(airflow_template)
    yield name
    await drop_database(name)


def dsn_of(database: str) -> str:
    return f"{_Server.get()}/{database}"


async def scalar(dsn: str, sql: str, *args: object) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def prepare(dsn: str, *, set_up: bool = True) -> None:
    """The DAG run tasks defer in, after ``triggerflow airflow setup`` unless ``set_up`` is
    false (rows Airflow wrote before triggerflow was set up)."""
    from triggerflow.airflow import setup as airflow_setup

    if set_up:
        await airflow_setup.setup(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await add_dag_run(conn)
    finally:
        await conn.close()


@dataclass
class DeferredTask:
    task_id: str
    trigger_id: int
    map_index: int = -1


DAG_ID = "tf_golden"
RUN_ID = "manual__golden"
DAG_VERSION_ID = uuid.UUID("01930000-0000-7000-8000-000000000001")


async def add_dag_run(conn: asyncpg.Connection) -> None:
    """The rows a deferred task instance hangs off: bundle, DAG, DAG run."""
    await conn.execute("INSERT INTO dag_bundle (name, active) VALUES ('dags-folder', true)")
    # dag.partition_mapper_info (NOT NULL) is Airflow 3.3's; 3.2 has no such column.
    partitioned = await conn.fetchval(
        "SELECT count(*) > 0 FROM information_schema.columns "
        "WHERE table_name = 'dag' AND column_name = 'partition_mapper_info'")
    await conn.execute(
        f"""INSERT INTO dag (dag_id, is_paused, is_stale, bundle_name, timetable_type,
                            max_active_tasks, max_consecutive_failed_dag_runs,
                            has_task_concurrency_limits, relative_fileloc, fileloc
                            {", partition_mapper_info" if partitioned else ""})
           VALUES ($1, false, false, 'dags-folder', '', 16, 0, false, 'golden.py',
                   '/dags/golden.py' {", '{}'" if partitioned else ""})""", DAG_ID)
    await conn.execute(
        """INSERT INTO dag_version (id, version_number, dag_id, bundle_name, created_at,
                                    last_updated)
           VALUES ($1, 1, $2, 'dags-folder', now(), now())""", DAG_VERSION_ID, DAG_ID)
    await conn.execute(
        """INSERT INTO dag_run (dag_id, run_id, run_type, run_after, logical_date, state,
                                start_date)
           VALUES ($1, $2, 'manual', now(), now(), 'running', now())""", DAG_ID, RUN_ID)


async def add_deferred_task(conn: asyncpg.Connection, task_id: str, classpath: str,
                            encrypted_kwargs: str, *, queue: str | None = None,
                            next_kwargs: Any = None, map_index: int = -1,
                            max_tries: int = 0) -> DeferredTask:
    """A task instance deferred on a new trigger row, as Airflow's API server writes them."""
    trigger_id = await conn.fetchval(
        """INSERT INTO "trigger" (classpath, kwargs, created_date, queue)
           VALUES ($1, $2, now(), $3) RETURNING id""", classpath, encrypted_kwargs, queue)
    await conn.execute(
        """INSERT INTO task_instance (id, task_id, dag_id, run_id, map_index, try_number,
                                      max_tries, pool, pool_slots, queue, priority_weight,
                                      operator, state, trigger_id, next_method, next_kwargs,
                                      start_date, updated_at, dag_version_id)
           VALUES ($1, $2, $3, $4, $5, 1, $10, 'default_pool', 1, coalesce($6, 'default'), 1,
                   'DateTimeSensorAsync', 'deferred', $7, 'execute_complete', $8::jsonb,
                   now() - interval '1 minute', now(), $9)""",
        uuid.uuid4(), task_id, DAG_ID, RUN_ID, map_index, queue, trigger_id,
        None if next_kwargs is None else json.dumps(next_kwargs), DAG_VERSION_ID, max_tries)
    return DeferredTask(task_id, int(trigger_id), map_index)


def serve_with_triggerflow(stack: AirflowStack, amqp_url: str, queues: list[str],
                           namespace: str, **overrides: Any) -> list[str]:
    """``triggerflow airflow setup`` and ``topology apply`` on ``stack``, then ``writer
    --airflow`` and one ``consume --airflow`` per queue as its processes (test settings:
    ``FAST``, then ``overrides``); returns their names for ``stack.stop_process``."""
    from triggerflow.settings import Settings

    settings = Settings(
        database_url=stack.database_url, amqp_url=amqp_url, namespace=namespace,
        allowed_modules=overrides.pop("allowed_modules",
                                      ["airflow.providers.standard.triggers",
                                       "tests.airflow_triggers"]),
        **{**FAST, **overrides},
    )
    env = {**stack.env, **settings.as_env(), "PYTHONUNBUFFERED": "1"}
    tf = [sys.executable, "-m", "triggerflow"]
    subprocess.run([*tf, "airflow", "setup", "--database-url", stack.database_url],
                   env=env, check=True, timeout=120)
    delete_queues(amqp_url, queues)
    queue_flags = [flag for q in queues for flag in ("--queue", q)]
    subprocess.run([*tf, "topology", "apply", *queue_flags], env=env, check=True, timeout=120)
    stack.spawn("tf-writer", [*tf, "writer", "--airflow"], env)
    for queue in queues:
        stack.spawn(f"tf-consume-{queue}", [*tf, "consume", "--airflow", "--queue", queue], env)
    return ["tf-writer", *(f"tf-consume-{queue}" for queue in queues)]
