"""Task trigger rows with no queue get their task's queue (the writer, in Airflow mode).

A worker that defers writes the trigger row with the task's queue (``[triggerer]
queues_enabled``: ``task_runner._defer_task`` sets ``queue = ti.task.queue``). Airflow 3.3.2's
scheduler writes the row of a ``start_from_trigger`` task itself (``TaskInstance.defer_task``,
no worker runs) and sets no queue, so only an ``airflow triggerer`` without ``--queues``
would run it, and a team's ``consume --airflow --queue Q`` never would. The writer gives such
a row the queue Airflow resolves for the task, ``task_instance.queue`` (the operator's
``queue``, ``[operators] default_queue`` when unset), as a worker's deferral would have, and
wakes that queue's consumers. Writing the row, not only routing it, is what keeps a no-queue
``airflow triggerer`` running beside triggerflow from taking it too: Airflow assigns rows by
``trigger.queue`` (``Trigger.assign_unassigned``).

Only rows no live Airflow triggerer holds (``triggerer_id`` NULL, or its job no longer
heart-beating within ``[triggerer] triggerer_health_check_threshold``) and, for a writer given
``--queue``, only tasks of those queues. Rows with no task instance (asset watchers,
callbacks) keep no queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

# $1 the trigger ids (NULL: every row with no queue), $2 the writer's queues (empty: any),
# $3 seconds after which an Airflow triggerer's heartbeat is stale (Airflow's default: 30).
ADOPT = """
UPDATE "trigger" t SET queue = ti.queue
FROM task_instance ti
WHERE t.queue IS NULL AND ($1::int[] IS NULL OR t.id = ANY($1::int[]))
  -- coalesce(): found by ti_trigger_id, never by the ti_state index (as events.APPLY)
  AND ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred' AND ti.queue IS NOT NULL
  AND (cardinality($2::text[]) = 0 OR ti.queue = ANY($2::text[]))
  AND (t.triggerer_id IS NULL OR NOT EXISTS (
        SELECT 1 FROM job j WHERE j.id = t.triggerer_id AND j.state = 'running'
          AND j.latest_heartbeat > now() - make_interval(secs => $3)))
RETURNING t.id, t.queue
"""

HEALTH_THRESHOLD = 30.0  # Airflow's [triggerer] triggerer_health_check_threshold default


async def adopt(pool: asyncpg.Pool, ids: Sequence[int] | None, queues: Sequence[str]) -> dict[str, list[int]]:
    """Give the task rows among ``ids`` (None: all) with no queue their task's queue;
    returns the ids adopted, by queue."""
    async with pool.acquire() as conn:
        rows = await conn.fetch(ADOPT, None if ids is None else list(ids), list(queues), HEALTH_THRESHOLD)
    adopted: dict[str, list[int]] = {}
    for row in rows:
        adopted.setdefault(row["queue"], []).append(row["id"])
    return adopted
