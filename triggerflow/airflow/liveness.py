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
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import asyncpg

from triggerflow.airflow.schema import SCHEMA

log = logging.getLogger(__name__)

# $1 the default queue (rows without one), $2 the writer's queues (empty: every queue).
# Rows of queues that have a live consumer are filtered out before the join, so on a healthy
# deployment the join sees nothing; the scan is of ``trigger`` alone.
UNSERVED_QUEUES = f"""
WITH live AS (
    SELECT DISTINCT unnest(queues) AS queue FROM {SCHEMA}.consumer
    WHERE kind = 'consumer' AND expires_at > now() AND subscribed
)
SELECT DISTINCT coalesce(t.queue, $1) AS queue
FROM "trigger" t
WHERE coalesce(t.queue, $1) IS NOT NULL
  AND (cardinality($2::text[]) = 0 OR coalesce(t.queue, $1) = ANY($2::text[]))
  AND coalesce(t.queue, $1) NOT IN (SELECT queue FROM live)
  AND EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
ORDER BY 1
"""


async def unserved_queues(
    conn: asyncpg.Connection, default_queue: str | None, queues: Sequence[str] = ()
) -> list[str]:
    """Queues with a deferred task's trigger and no live, subscribed consumer."""
    rows = await conn.fetch(UNSERVED_QUEUES, default_queue, list(queues))
    return [row["queue"] for row in rows]


def served_check(
    default_queue: str | None, queues: Sequence[str] = ()
) -> Callable[[asyncpg.Connection], Awaitable[bool]]:
    """The heartbeat's condition: True when no queue with deferred work lacks a consumer;
    logs the unserved queues when that changes (not every interval)."""
    last: list[str] = []

    async def served(conn: asyncpg.Connection) -> bool:
        nonlocal last
        unserved = await unserved_queues(conn, default_queue, queues)
        if unserved != last:
            if unserved:
                log.warning(
                    "triggerer heartbeat withheld: deferred work and no live consumer on %s",
                    ", ".join(unserved),
                )
            else:
                log.info("triggerer heartbeat resumed: every queue with deferred work has a consumer")
            last = unserved
        return not unserved

    return served
