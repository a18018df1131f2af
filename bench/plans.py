"""The hot statements' plans with and without planner statistics (issue 22).

``python -m testbed.services -- python -m bench.plans HELD BURST`` migrates the database it
is given (``TRIGGERFLOW_DATABASE_URL``), turns autovacuum off on the hot tables, defers
HELD far timers and BURST due ones through ``triggerflow defer`` (as a wave of deferrals
would, with no ANALYZE since the tables were created), claims them for one consumer row, and
prints ``EXPLAIN (ANALYZE, BUFFERS)`` of CLAIM and APPLY_EVENTS (each rolled back); then
ANALYZE and APPLY_EVENTS again. The line to look for is ``Rows Removed by Join Filter``: a
join that compares every event with every waiting task.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import asyncpg

from triggerflow.store.postgres.statements import claims, lease, writer

QUEUE = "plans"
NAMESPACE = "plans"


def _cli(*args: str) -> None:
    env = {**os.environ, "TRIGGERFLOW_NAMESPACE": NAMESPACE}
    subprocess.run([sys.executable, "-m", "triggerflow", *args], check=True, env=env, capture_output=True)


def _defer(n: int, moment: str, dag: str) -> None:
    _cli(
        "defer",
        "--count",
        str(n),
        "--queue",
        QUEUE,
        "--dag-id",
        dag,
        "--batch",
        "5000",
        "--trigger",
        "triggerflow.triggers.temporal.DateTimeTrigger",
        "--kwargs",
        f'{{"moment": "{moment}"}}',
    )


async def _explain(con: asyncpg.Connection, statement: str, args: list[Any], label: str) -> None:
    """Print the plan of ``statement`` as it ran, then roll its writes back."""
    tr = con.transaction()
    await tr.start()
    try:
        started = time.perf_counter()
        rows = await con.fetch("EXPLAIN (ANALYZE, BUFFERS) " + statement, *args)
        elapsed = time.perf_counter() - started
    finally:
        await tr.rollback()
    print(f"=== {label} ({elapsed * 1000:.1f} ms with the round trip)")
    for r in rows:
        print(r[0][:160])  # an ANY(array) condition would print every id


async def _apply_args(con: asyncpg.Connection) -> list[Any]:
    rows = await con.fetch(
        "SELECT t.id, t.attempt, t.queue FROM trigger t JOIN task_instance ti "
        "ON ti.trigger_id = t.id WHERE ti.dag_id = 'burst' ORDER BY t.id"
    )
    n = len(rows)
    return [
        [r["id"] for r in rows],
        [r["attempt"] for r in rows],
        [r["queue"] for r in rows],
        ["resume"] * n,
        ['"2026-12-01T00:00:00+00:00"'] * n,
        [time.time()] * n,
    ]


async def main(held: int, burst: int) -> None:
    dsn = os.environ["TRIGGERFLOW_DATABASE_URL"]
    _cli("db", "upgrade")
    _cli("topology", "apply", "--queue", QUEUE)
    con = await asyncpg.connect(dsn)
    try:
        for table in ("trigger", "task_instance", "consumer"):
            await con.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        me = await con.fetchval(lease.NATIVE.register, "consumer", "bench", 1, [QUEUE], 10**7, "-", 3600.0)
        _defer(held, "2099-01-01T00:00:00+00:00", "held")
        await con.execute("UPDATE trigger SET owner_id = $1, attempt = attempt + 1", me)
        _defer(burst, "2026-12-01T00:00:00+00:00", "burst")
        ids = [r[0] for r in await con.fetch("SELECT id FROM trigger WHERE owner_id IS NULL")]
        await _explain(con, claims.CLAIM, [me, ids, [QUEUE]], "CLAIM, no statistics")
        await con.execute(
            "UPDATE trigger SET owner_id = $1, attempt = attempt + 1 WHERE owner_id IS NULL", me
        )
        args = await _apply_args(con)
        for label in ("APPLY_EVENTS, no statistics", "APPLY_EVENTS, fresh statistics"):
            if "fresh" in label:
                await con.execute("ANALYZE trigger, task_instance, consumer")
            await _explain(con, writer.APPLY_EVENTS, args, label)
    finally:
        await con.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
