"""Install and remove triggerflow's schema in an Airflow metadata database (idempotent)."""

from __future__ import annotations

import asyncpg

from triggerflow.airflow import cancels, schema
from triggerflow.errors import ConfigurationError


class UnknownAirflowSchema(ConfigurationError, RuntimeError):
    """The database is not an Airflow schema version this code was checked against."""


async def airflow_revision(conn: asyncpg.Connection) -> str | None:
    """The alembic revision of Airflow's schema, or None when there is no Airflow schema."""
    if await conn.fetchval("SELECT to_regclass('dag_run') IS NULL"):
        return None  # e.g. triggerflow's native schema: it has its own alembic_version
    try:
        value = await conn.fetchval(schema.AIRFLOW_REVISION)
    except asyncpg.UndefinedTableError:
        return None
    return None if value is None else str(value)


async def check_airflow_schema(conn: asyncpg.Connection) -> str:
    """Return the Airflow release whose schema this is, or raise ``UnknownAirflowSchema``."""
    revision = await airflow_revision(conn)
    known = {rev: release for release, rev in schema.KNOWN_AIRFLOW_REVISIONS.items()}
    if revision is None:
        raise UnknownAirflowSchema(
            "no Airflow schema in this database (no dag_run or alembic_version table): "
            "point --database-url at Airflow's metadata database, after `airflow db migrate`")
    if revision not in known:
        supported = ", ".join(f"{release} ({rev})"
                              for release, rev in schema.KNOWN_AIRFLOW_REVISIONS.items())
        raise UnknownAirflowSchema(
            f"Airflow schema revision {revision} is not one triggerflow knows; supported: "
            f"{supported}. Upgrade triggerflow (or Airflow) so they match.")
    return known[revision]


async def setup(dsn: str) -> str:
    """Create (or bring up to date) triggerflow's schema; returns the Airflow release found."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            release = await check_airflow_schema(conn)
            # Serialise concurrent set-ups: CREATE OR REPLACE of the same function races.
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('triggerflow.airflow.setup'))")
            await conn.execute(schema.CREATE)
            await conn.execute(schema.NOTIFY_TRIGGER)
            await conn.execute(cancels.CREATE)  # the cancel log and its triggers (cancels.py)
            await conn.execute(schema.RECORD_META, schema.SCHEMA_VERSION,
                               schema.KNOWN_AIRFLOW_REVISIONS[release])
        return release
    finally:
        await conn.close()


async def teardown(dsn: str) -> None:
    """Remove everything ``setup`` created; Airflow's own rows and tables are left as they are."""
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            await conn.execute(cancels.DROP)
            await conn.execute(schema.DROP)
    finally:
        await conn.close()


async def installed(dsn: str) -> tuple[bool, bool]:
    """(schema present, NOTIFY trigger present)."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(schema.INSTALLED)
        return bool(row["schemas"]), bool(row["notify_triggers"])
    finally:
        await conn.close()
