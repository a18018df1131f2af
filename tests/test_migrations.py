"""The schema's life cycle against the suite's PostgreSQL: ``db downgrade`` one step and
``db upgrade`` again through the CLI, every migration's ``downgrade()`` run (head -> base ->
head leaves the schema it started from), and the refusals of ``db downgrade``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import asyncpg
import pytest

from tests.conftest import ROOT, settings_env
from triggerflow.settings import Settings
from triggerflow.store.postgres import current_revision, downgrade_schema, revisions, upgrade_schema

REVISIONS = [r for r, _ in revisions()]
HEAD, PREVIOUS = REVISIONS[-1], REVISIONS[-2]

# What a migration creates or drops: columns, constraints, indexes, row security, triggers,
# functions (by definition, so a changed body counts too).
SCHEMA = """
SELECT 'column ' || table_name || '.' || column_name || ' ' || data_type || ' '
       || is_nullable || ' ' || coalesce(column_default, '')
  FROM information_schema.columns WHERE table_schema = 'public'
UNION ALL SELECT 'constraint ' || conrelid::regclass || ' ' || pg_get_constraintdef(oid)
  FROM pg_constraint WHERE connamespace = 'public'::regnamespace
UNION ALL SELECT 'index ' || indexdef FROM pg_indexes WHERE schemaname = 'public'
UNION ALL SELECT 'policy ' || tablename || ' ' || policyname || ' ' || cmd || ' '
       || coalesce(qual, '') || ' ' || coalesce(with_check, '') FROM pg_policies
UNION ALL SELECT 'rls ' || relname || ' ' || relrowsecurity || ' ' || relforcerowsecurity
  FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
UNION ALL SELECT 'trigger ' || pg_get_triggerdef(oid) FROM pg_trigger WHERE NOT tgisinternal
UNION ALL SELECT 'function ' || pg_get_functiondef(p.oid)
  FROM pg_proc p WHERE pronamespace = 'public'::regnamespace
"""


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "triggerflow", *args],
                          env=settings_env(settings), cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


async def schema_of(dsn: str) -> list[str]:
    conn = await asyncpg.connect(dsn)
    try:
        # alembic's own bookkeeping table stays at base
        return sorted(r[0] for r in await conn.fetch(SCHEMA) if "alembic_version" not in r[0])
    finally:
        await conn.close()


async def test_downgrade_one_step_and_upgrade_again(settings: Settings, dsn: str) -> None:
    """The suite's database is at head; one step down runs the newest ``downgrade()``,
    ``db current`` says so, and ``db upgrade`` brings the same schema back."""
    at_head = await schema_of(dsn)
    assert ok(cli(settings, "db", "current")).endswith(f"at {HEAD} (head)")
    assert ok(cli(settings, "db", "downgrade", PREVIOUS)).endswith(f"at {PREVIOUS} (was {HEAD})")
    assert await current_revision(dsn) == PREVIOUS
    assert ok(cli(settings, "db", "current")).endswith(f"at {PREVIOUS} (head is {HEAD})")
    assert await schema_of(dsn) != at_head
    ok(cli(settings, "db", "upgrade"))
    assert await current_revision(dsn) == HEAD
    assert await schema_of(dsn) == at_head


async def test_every_downgrade_runs_and_undoes_its_upgrade(dsn: str) -> None:
    """head -> base -> head one revision at a time: each ``downgrade()`` runs, and each
    revision's schema on the way back up is the one it had on the way down (a downgrade that
    leaves a column, an index or a policy behind fails here, or in the upgrade after it)."""
    down: dict[str, list[str]] = {}
    for revision in reversed(REVISIONS):
        assert await current_revision(dsn) == revision
        down[revision] = await schema_of(dsn)
        below = REVISIONS.index(revision) - 1
        await asyncio.to_thread(downgrade_schema, dsn, REVISIONS[below] if below >= 0 else "base")
    assert await schema_of(dsn) == [], "base still holds part of the schema"
    for revision in REVISIONS:
        await asyncio.to_thread(upgrade_schema, dsn, revision)
        assert await schema_of(dsn) == down[revision], f"revision {revision} differs"


@pytest.mark.parametrize(("target", "says"), [
    ("base", "unknown revision 'base'"),
    ("9999", "unknown revision '9999'"),
    (HEAD, None),  # filled below: the database is one step down, so head is an upgrade
])
async def test_downgrade_refuses_in_one_line(settings: Settings, dsn: str, target: str,
                                             says: Any) -> None:
    await asyncio.to_thread(downgrade_schema, dsn, PREVIOUS)
    done = cli(settings, "db", "downgrade", target)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    expected = says or f"use `triggerflow db upgrade --revision {HEAD}`"
    assert expected in lines[0]
    assert await current_revision(dsn) == PREVIOUS, "a refused downgrade changed the schema"


def test_history_lists_every_revision_oldest_first() -> None:
    done = subprocess.run([sys.executable, "-m", "triggerflow", "db", "history"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    listed = [line.split()[0] for line in ok(done).splitlines()]
    assert listed == REVISIONS


def test_version_is_the_packages() -> None:
    """``triggerflow --version`` prints pyproject's version (the installed metadata)."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done = subprocess.run([sys.executable, "-m", "triggerflow", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == version
