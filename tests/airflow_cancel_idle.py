"""What stopping triggers promptly costs in Airflow mode, and how prompt it is.

    .venv/bin/python -m testbed.services -- .venv/bin/python -m tests.airflow_cancel_idle

On a migrated Airflow 3.3.2 database (no Airflow process: only triggerflow's writer and one
consumer, default settings, so every statement counted is theirs), with pg_stat_statements:

1. statements per second over ``WINDOW`` seconds while nothing is held, by statement;
2. the same while the consumer holds ``HELD`` triggers (``DateTimeTrigger`` rows an hour
   ahead, as Airflow's API server writes them);
3. ``ROUNDS`` times: one task marked failed from a plain session (as Airflow's API server
   does), timed until the consumer has dropped triggerflow's bookkeeping row for it (it does
   so right after stopping the trigger): the row change to the consumer's reaction.
"""

# A measurement driver, not a service: it polls and starts processes on purpose.
# ruff: noqa: ASYNC110, ASYNC220

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid

import asyncpg
import pendulum

from tests import airflow_support as af
from triggerflow.settings import Settings

WINDOW, HELD, ROUNDS, QUEUE = 30.0, 1000, 20, "tf-idle"


async def defer_many(dsn: str, n: int, prefix: str) -> list[int]:
    from triggerflow.airflow.kwargs import encrypt_kwargs

    kwargs = encrypt_kwargs({"moment": pendulum.now("UTC").add(hours=1), "end_from_trigger": False})
    conn = await asyncpg.connect(dsn)
    ids = []
    try:
        for i in range(n):
            # one transaction, as Airflow's API server writes them: the writer's clean-up
            # would delete a trigger row committed before its task instance
            async with conn.transaction():
                task = await af.add_deferred_task(
                    conn,
                    f"{prefix}{i}",
                    "airflow.providers.standard.triggers.temporal.DateTimeTrigger",
                    kwargs,
                    queue=QUEUE,
                )
            ids.append(task.trigger_id)
        return ids
    finally:
        await conn.close()


async def per_second(conn: asyncpg.Connection, label: str) -> None:
    await conn.execute("SELECT pg_stat_statements_reset()")
    await asyncio.sleep(WINDOW)
    rows = await conn.fetch(
        "SELECT calls, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) AS q "
        "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
        "WHERE datname = current_database()) AND query NOT ILIKE '%pg_stat_statements%' "
        "ORDER BY calls DESC"
    )
    total = sum(r["calls"] for r in rows)
    print(f"\n{label}: {total / WINDOW:.2f} statements/s over {WINDOW:.0f} s")
    for r in rows:
        print(f"  {r['calls'] / WINDOW:6.3f}/s  {r['q']}")


async def main() -> None:
    server = os.environ["TRIGGERFLOW_DATABASE_URL"].rsplit("/", 1)[0]
    af._Server.url = server
    name = f"tf_idle_{uuid.uuid4().hex[:8]}"
    await af.admin_sql(server, f'CREATE DATABASE "{name}"')
    procs: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run(
            [str(af.BIN / "airflow"), "db", "migrate"],
            check=True,
            capture_output=True,
            env={**os.environ, **af.airflow_env(name)},
            timeout=600,
        )
        dsn = af.dsn_of(name)
        await af.prepare(dsn)
        settings = Settings(
            database_url=dsn,
            amqp_url=os.environ["TRIGGERFLOW_AMQP_URL"],
            namespace=f"tfidle{os.getpid()}",
            allowed_modules=["airflow.providers.standard.triggers"],
        )
        env = {**os.environ, **af.airflow_env(name), **settings.as_env()}
        tf = [sys.executable, "-m", "triggerflow"]
        subprocess.run([*tf, "topology", "apply", "--queue", QUEUE], env=env, check=True, timeout=120)
        procs = [
            subprocess.Popen([*tf, "writer", "--airflow"], env=env),
            subprocess.Popen([*tf, "consume", "--airflow", "--queue", QUEUE], env=env),
        ]
        conn = await asyncpg.connect(dsn)
        await conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        while not await conn.fetchval("SELECT count(*) = 2 FROM triggerflow.consumer"):
            await asyncio.sleep(0.5)
        await asyncio.sleep(15)  # both registered, first renewals done
        await per_second(conn, "idle, nothing held")
        await defer_many(dsn, HELD, "held")
        while (
            await conn.fetchval("SELECT count(*) FROM triggerflow.trigger_state WHERE owner_id IS NOT NULL")
            < HELD
        ):
            await asyncio.sleep(0.5)
        await per_second(conn, f"{HELD} held, none cancelled")
        lags = []
        for trigger_id in await defer_many(dsn, ROUNDS, "round"):
            while not await conn.fetchval(
                "SELECT owner_id IS NOT NULL FROM triggerflow.trigger_state WHERE trigger_id = $1", trigger_id
            ):
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await conn.execute("UPDATE task_instance SET state = 'failed' WHERE trigger_id = $1", trigger_id)
            while await conn.fetchval(
                "SELECT count(*) FROM triggerflow.trigger_state WHERE trigger_id = $1", trigger_id
            ):
                await asyncio.sleep(0.005)
            lags.append((time.monotonic() - t0) * 1000)
        lags.sort()
        print(
            f"\nrow change -> consumer dropped it, {ROUNDS} rounds: p50 "
            f"{statistics.median(lags):.1f} ms, max {lags[-1]:.1f} ms "
            "(5 ms polling included)"
        )
        await conn.close()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
        await af.admin_sql(server, af.drop_database_sql(name))


if __name__ == "__main__":
    asyncio.run(main())
