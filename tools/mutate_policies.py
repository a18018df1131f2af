"""Row-security policies as mutation targets (``tools/mutate_sql.py``).

A policy is not a constant a store reads at run time: it lives in the database, created by
a migration. Its text is read by running the migration's ``upgrade()`` against a recording
``op`` (nothing reaches a database), and a mutant is put in place in the test session's
template database (``DROP POLICY`` then the mutated ``CREATE POLICY``), which every case
copies its database from; the original is put back the same way.
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Iterator
from typing import Any

import asyncpg

from tools.sql_mutants import Mutant, mutants

MIGRATIONS = "triggerflow.migrations.versions."
# The migrations that create policies (a later migration altering one would be read here too).
WITH_POLICIES = ("0002_team_row_security", "0006_team_consumer_rows", "0011_trigger_id_drawn")
_CREATE = re.compile(r"CREATE POLICY (\w+) ON (\w+)", re.I)
_CLAUSE = re.compile(r"\b(USING|WITH CHECK)\s*\(", re.I)


class _Recorder:
    """Stands in for ``alembic.op``: keeps what ``execute`` is given, ignores the rest."""

    def __init__(self) -> None:
        self.executed: list[str] = []

    def execute(self, sql: Any) -> None:
        self.executed.append(str(sql))

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def policies() -> dict[tuple[str, str], str]:
    """(table, policy) -> its ``CREATE POLICY`` text, the last migration's word on it."""
    found: dict[tuple[str, str], str] = {}
    for name in WITH_POLICIES:
        module = importlib.import_module(MIGRATIONS + name)
        recorder, op = _Recorder(), getattr(module, "op")  # noqa: B009 - a module's global
        setattr(module, "op", recorder)  # noqa: B010
        try:
            module.upgrade()
        finally:
            setattr(module, "op", op)  # noqa: B010
        for sql in recorder.executed:
            m = _CREATE.search(sql)
            if m:
                found[m.group(2), m.group(1)] = " ".join(sql.split())
    return found


def _clauses(sql: str) -> Iterator[tuple[str, int, int]]:
    """Each ``USING (...)`` / ``WITH CHECK (...)``: its keyword and the span inside."""
    for m in _CLAUSE.finditer(sql):
        depth, start = 1, m.end()
        for i in range(start, len(sql)):
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            if depth == 0:
                yield m.group(1).upper(), start, i
                break


def policy_mutants(sql: str) -> list[Mutant]:
    """The statement mutants of the policy, and each of its clauses made ``true`` (a check
    that checks nothing: the ``WITH CHECK (true)`` a re-pointed lease row got through)."""
    clauses = list(_clauses(sql))
    out = [Mutant(f"`{kw} (…)` -> `{kw} (true)`", sql[:a] + "true" + sql[b:])
           for kw, a, b in clauses]
    for mutant in mutants(sql):  # one line: name the clause instead (USING and WITH CHECK
        at = next(i for i, (x, y) in enumerate(zip(sql, mutant.text, strict=False)) if x != y)
        where = next((kw for kw, a, b in clauses if a <= at <= b), "")  # often read alike)
        out.append(Mutant(re.sub(r"^L\d+", where or "L1", mutant.description), mutant.text))
    return out


def put(server: str, template: str, table: str, policy: str, sql: str) -> None:
    """Replace the policy in the template database (no session may stay connected to it)."""
    async def run() -> None:
        conn = await asyncpg.connect(f"{server}/{template}")
        try:
            async with conn.transaction():
                await conn.execute(f"DROP POLICY {policy} ON {table}")
                await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run())
