"""The triggerer job row: what Airflow's health checks read to decide a triggerer is alive.

``airflow jobs check --job-type TriggererJob`` and the API server's health endpoint look for a
``job`` row of type ``TriggererJob`` in state ``running`` whose ``latest_heartbeat`` is recent.
A writer inserts one such row when it starts, stamps it every interval and closes it when it
stops; a writer killed outright leaves a row whose heartbeat goes stale, which Airflow reads as
an unhealthy triggerer, as it would for its own. Given ``stamp``, the row is stamped by
it (``liveness.served_beat``: only while no trigger row with work goes unserved).
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg

from triggerflow.lifecycle import Tasks

log = logging.getLogger(__name__)

JOB_TYPE = "TriggererJob"

START = """
INSERT INTO job (state, job_type, start_date, latest_heartbeat, hostname, unixname)
VALUES ('running', $1, now(), now(), $2, $3)
RETURNING id
"""

BEAT = "UPDATE job SET latest_heartbeat = now() WHERE id = $1 AND state = 'running'"

STOP = "UPDATE job SET state = 'success', end_date = now() WHERE id = $1"


async def start_job(conn: asyncpg.Connection, hostname: str | None = None) -> int:
    job_id = await conn.fetchval(START, JOB_TYPE, hostname or socket.getfqdn(), getpass.getuser())
    return int(job_id)


async def beat(conn: asyncpg.Connection, job_id: int) -> bool:
    """Stamp the heartbeat; False when the row was closed (by ``stop_job`` or by hand)."""
    return str(await conn.execute(BEAT, job_id)) == "UPDATE 1"


async def stop_job(conn: asyncpg.Connection, job_id: int) -> None:
    await conn.execute(STOP, job_id)


@contextlib.asynccontextmanager
async def triggerer_job(pool: asyncpg.Pool, interval: float = 5.0,
                        stamp: Callable[[asyncpg.Connection, int], Awaitable[bool]] = beat,
                        ) -> AsyncIterator[int]:
    """Keep a triggerer job row heart-beating while the block runs; yields the job id.

    A heartbeat that fails (database restarting) is logged and retried next interval: the
    row goes stale, so Airflow reports the triggerer unhealthy only while it really cannot
    write.
    """
    async with pool.acquire() as conn:
        job_id = await start_job(conn)

    async def keep_beating() -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                async with pool.acquire() as conn:
                    await stamp(conn, job_id)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("triggerer heartbeat failed: %r", exc)

    try:
        async with Tasks() as beating:
            beating.start("airflow-triggerer-heartbeat", keep_beating())
            yield job_id
    finally:
        # Bounded: a writer stopping while the database is away must still exit (the row
        # then goes stale, which Airflow reads as a stopped triggerer anyway).
        with contextlib.suppress(OSError, asyncpg.PostgresError, asyncpg.InterfaceError,
                                 TimeoutError):
            async with asyncio.timeout(5), pool.acquire() as conn:
                await stop_job(conn, job_id)
