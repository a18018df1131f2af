"""Creating the database and applying the Alembic migrations shipped in the package.

URLs are parsed with SQLAlchemy's ``make_url`` (through :mod:`.urls`, which also takes a list
of hosts), never edited as strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg

from triggerflow.store.postgres.urls import parse, render

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def with_database(dsn: str, database: str) -> str:
    """``dsn`` pointing at another database of the same server."""
    return render(parse(dsn).set(database=database))


def database_name(dsn: str) -> str:
    return parse(dsn).database or "postgres"


async def ensure_database(dsn: str) -> bool:
    """Create the database named by ``dsn`` if it is missing. Returns True when created."""
    name = database_name(dsn)
    conn = await asyncpg.connect(with_database(dsn, "postgres"))
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if exists:
            return False
        quoted = '"' + name.replace('"', '""') + '"'
        await conn.execute(f"CREATE DATABASE {quoted}")
        return True
    finally:
        await conn.close()


def _alembic_config(dsn: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # SQLAlchemy's asyncpg dialect takes the hosts as ``?host=`` parameters (parse's form)
    url = parse(dsn).set(drivername="postgresql+asyncpg")
    cfg.set_main_option("sqlalchemy.url", url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def upgrade_schema(dsn: str, revision: str = "head") -> None:
    """Apply the migrations up to ``revision`` (blocking)."""
    from alembic import command

    command.upgrade(_alembic_config(dsn), revision)


def downgrade_schema(dsn: str, revision: str) -> None:
    """Run the migrations' ``downgrade()`` down to ``revision`` (blocking). ``base`` drops
    every table: the command line refuses it (see :func:`revisions`)."""
    from alembic import command

    command.downgrade(_alembic_config(dsn), revision)


def revisions() -> list[tuple[str, str]]:
    """The shipped revisions, oldest first: (id, first line of its docstring)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(MIGRATIONS))
    found = [(r.revision, (r.doc or "").strip().splitlines()[0] if r.doc else "")
             for r in script.walk_revisions()]
    return found[::-1]


async def current_revision(dsn: str) -> str | None:
    """The revision the database is at; None when no migration ever ran there."""
    conn = await asyncpg.connect(dsn)
    try:
        if await conn.fetchval("SELECT to_regclass('alembic_version')") is None:
            return None
        return await conn.fetchval("SELECT version_num FROM alembic_version")  # type: ignore[no-any-return]
    finally:
        await conn.close()
