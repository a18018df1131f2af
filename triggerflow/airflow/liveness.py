"""What the writer's ``TriggererJob`` heartbeat vouches for: every queue with deferred work has
a live consumer.

Airflow's health checks (``airflow jobs check --job-type TriggererJob``, the API server's
``/api/v2/monitor/health``) read a triggerer as healthy while its job row's heartbeat is
recent. Under ``airflow triggerer`` that row is the process that runs the triggers; under
triggerflow the writer holds it, and a writer alone runs nothing. So the writer stamps the row
only while each queue that has a deferred task's trigger (``trigger.queue``, or the default
queue for rows without one; only triggerflow's queues when the writer is given ``--queue``)
has at least one consumer whose lease is unexpired and which is subscribed on the broker.
Otherwise it skips the stamp and names the queues, and once the heartbeat is older than
``[triggerer] triggerer_health_check_threshold`` Airflow reports the triggerer unhealthy.
The check and the stamp are one statement (``BEAT_IF_SERVED``): an idle writer's statements
per second are what its database pays for it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from triggerflow.airflow.schema import SCHEMA

log = logging.getLogger(__name__)

# One statement reads the unserved queues and stamps the heartbeat only when there are none.
# $1 the default queue (rows without one), $2 the writer's queues (empty: every queue), $3 the
# job row (NULL: read only). Rows of queues that have a live consumer are filtered out before
# the join, so on a healthy deployment the join sees nothing; the scan is of ``trigger``
# alone. A row per unserved queue, or one with a NULL queue. No array in the result: asyncpg
# would look its type up once on every pooled connection (two more statements each time).
BEAT_IF_SERVED = f"""
WITH live AS (
    SELECT DISTINCT unnest(queues) AS queue FROM {SCHEMA}.consumer
    WHERE kind = 'consumer' AND expires_at > now() AND subscribed
), unserved AS (
    SELECT DISTINCT coalesce(t.queue, $1) AS queue
    FROM "trigger" t
    WHERE coalesce(t.queue, $1) IS NOT NULL
      AND (cardinality($2::text[]) = 0 OR coalesce(t.queue, $1) = ANY($2::text[]))
      AND coalesce(t.queue, $1) NOT IN (SELECT queue FROM live)
      AND EXISTS (SELECT 1 FROM task_instance ti
                  WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
), beat AS (
    UPDATE job SET latest_heartbeat = now()
    WHERE id = $3 AND state = 'running' AND NOT EXISTS (SELECT 1 FROM unserved)
    RETURNING id
)
SELECT u.queue, EXISTS (SELECT 1 FROM beat) AS beaten
FROM (VALUES (1)) AS one (x) LEFT JOIN unserved u ON true
ORDER BY u.queue
"""


async def beat_if_served(conn: asyncpg.Connection, default_queue: str | None,
                         queues: Sequence[str], job_id: int | None) -> tuple[list[str], bool]:
    """The queues with a deferred task's trigger and no live, subscribed consumer, and whether
    job ``job_id``'s heartbeat was stamped (only when there are none; never for None)."""
    rows = await conn.fetch(BEAT_IF_SERVED, default_queue, list(queues), job_id)
    return [r["queue"] for r in rows if r["queue"] is not None], bool(rows[0]["beaten"])


async def unserved_queues(
    conn: asyncpg.Connection, default_queue: str | None, queues: Sequence[str] = ()
) -> list[str]:
    """Queues with a deferred task's trigger and no live, subscribed consumer."""
    unserved, _ = await beat_if_served(conn, default_queue, queues, None)
    return unserved


def served_beat(
    default_queue: str | None, queues: Sequence[str] = ()
) -> Callable[[asyncpg.Connection, int], Awaitable[bool]]:
    """The heartbeat (``heartbeat.triggerer_job``'s ``beat``): stamps the job row only when
    no queue with deferred work lacks a consumer, in one statement; logs the unserved queues
    when that changes (not every interval). Returns whether the row was stamped."""
    last: list[str] = []

    async def beat(conn: asyncpg.Connection, job_id: int) -> bool:
        nonlocal last
        unserved, beaten = await beat_if_served(conn, default_queue, queues, job_id)
        if unserved != last:
            if unserved:
                log.warning(
                    "triggerer heartbeat withheld: deferred work and no live consumer on %s",
                    ", ".join(unserved),
                )
            else:
                log.info("triggerer heartbeat resumed: every queue with deferred work has a consumer")
            last = unserved
        return beaten

    return beat
