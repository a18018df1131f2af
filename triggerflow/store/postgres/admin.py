"""Statements of the operator commands (status, show, requeue, unquarantine, health) and of
the reference host (the demo's resumer). Not on any hot path of the loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from triggerflow.model import FAIL_METHOD


@dataclass(frozen=True)
class StatusStatements:
    """What ``triggerflow status`` and ``health`` read, in one mode's tables
    (``Mode.status_statements``): processes by lease, writers, per-queue trigger counts
    (``queue``, ``triggers``, ``owned``, ``unclaimed``, ``quarantined``, ``dead_owner``), the
    overdue count, quarantined triggers.
    ``queues`` and ``quarantined`` are run with ``queue_args`` and ``quarantined_args``;
    ``unserved`` (a mode whose rows can wait where no consumer looks: Airflow's), with
    ``unserved_args``, lists rows nothing serves (``queue``, ``reason``, ``id``, ``kind``,
    ``classpath``, ``total``: the first few of each queue and reason). ``health``: this
    host's process rows, newest first (``$1`` host, ``$2`` kind or 'any', ``$3`` pid or NULL).
    ``trigger_ids``: state -> the statement listing ids in it (``status --ids``, which feeds
    requeue and unquarantine); None in a mode that has neither."""

    consumers: str
    writers: str
    queues: str
    overdue: str
    quarantined: str
    health: str
    queue_args: tuple[Any, ...] = ()
    quarantined_args: tuple[Any, ...] = ()
    unserved: str | None = None
    unserved_args: tuple[Any, ...] = ()
    trigger_ids: Callable[[str], str] | None = None


STATUS_CONSUMERS = """
SELECT id, kind, host, pid, queues, capacity, running, version, started_at, renewed_at,
       expires_at, expires_at > now() AS alive, cardinality(probation) AS on_probation,
       extract(epoch FROM now() - started_at)::float8 AS started_ago, subscribed, clock_skew,
       warming
FROM consumer ORDER BY kind, id
"""

STATUS_QUEUES = """
SELECT queue,
       count(*) AS triggers,
       count(*) FILTER (WHERE owner_id IS NOT NULL) AS owned,
       count(*) FILTER (WHERE owner_id IS NULL AND quarantined_at IS NULL) AS unclaimed,
       count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS quarantined,
       count(*) FILTER (WHERE owner_id IS NOT NULL AND NOT EXISTS (
           SELECT 1 FROM consumer c WHERE c.id = owner_id AND c.expires_at > now())) AS dead_owner
FROM trigger GROUP BY queue ORDER BY queue
"""

STATUS_OVERDUE = """
SELECT count(*) FROM task_instance
WHERE state = 'deferred' AND trigger_timeout < now() - interval '10 seconds'
"""

QUARANTINED = """
SELECT id, queue, classpath, failures, quarantined_at, last_error FROM trigger
WHERE quarantined_at IS NOT NULL ORDER BY id
"""

SHOW_TRIGGER = """
SELECT t.id, t.classpath, t.queue, t.created_at, t.dispatched_at, t.owner_id, t.claimed_at,
       t.attempt, t.failures, t.rejected_by, t.quarantined_at, t.last_error, t.timeout_at,
       c.host AS owner_host, c.expires_at > now() AS owner_alive,
       ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.state AS task_state
FROM trigger t
LEFT JOIN consumer c ON c.id = t.owner_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id
WHERE t.id = $1
"""

# -- commands that change state

# Release and re-send triggers that no live consumer runs (never claimed, rejected by every
# consumer, or owned by a dead or vanished consumer). With $2 (--force) also those a live
# consumer holds: its copy keeps running until it fires or times out, but its event carries
# the old attempt and the writer ignores it. Quarantined triggers need unquarantine.
REQUEUE_IDLE = """
UPDATE trigger t SET owner_id = NULL, dispatched_at = now(), rejected_by = '{}'
WHERE t.id = ANY($1::bigint[]) AND t.quarantined_at IS NULL
  AND ($2 OR t.owner_id IS NULL OR NOT EXISTS (
        SELECT 1 FROM consumer c WHERE c.id = t.owner_id AND c.expires_at > now()))
RETURNING t.id, t.queue
"""

LIVE_OWNERS = """
SELECT t.id, c.id AS owner_id, c.host, c.pid FROM trigger t
JOIN consumer c ON c.id = t.owner_id AND c.expires_at > now()
WHERE t.id = ANY($1::bigint[])
"""

# Undo a quarantine. The task the quarantine failed (still linked by trigger_id) is deferred
# again with its original continuation and timeout, and the trigger re-sent. If the host has
# already handled that failure (the task left 'scheduled'/'__fail__'), the trigger is dropped
# instead: re-running it could no longer resume anything.
UNQUARANTINE_SAFE = f"""
WITH target AS (
    SELECT t.id, t.queue, t.timeout_at, ti.id AS ti_id,
           coalesce(ti.state = 'scheduled' AND ti.next_method = '{FAIL_METHOD}'
                    AND ti.next_kwargs ? 'deferred_next_method', false) AS resumable
    FROM trigger t LEFT JOIN task_instance ti ON ti.trigger_id = t.id
    WHERE t.id = ANY($1::bigint[]) AND t.quarantined_at IS NOT NULL
    FOR UPDATE OF t
), redeferred AS (
    UPDATE task_instance ti SET state = 'deferred', end_date = NULL,
           next_method = ti.next_kwargs->>'deferred_next_method',
           next_kwargs = ti.next_kwargs->'deferred_next_kwargs',
           trigger_timeout = target.timeout_at, updated_at = clock_timestamp()
    FROM target
    WHERE ti.id = target.ti_id AND target.resumable
      AND ti.state = 'scheduled' AND ti.next_method = '{FAIL_METHOD}'
    RETURNING target.id
), freed AS (
    UPDATE trigger t SET quarantined_at = NULL, failures = 0, rejected_by = '{{}}',
           blocked_attempts = '{{}}',
           owner_id = NULL, dispatched_at = now(), last_error = NULL
    FROM target WHERE t.id = target.id AND target.resumable
    RETURNING t.id, t.queue
), dropped AS (
    DELETE FROM trigger t USING target WHERE t.id = target.id AND NOT target.resumable
    RETURNING t.id
)
SELECT id, queue, true AS resent FROM freed
UNION ALL
SELECT id, NULL, false FROM dropped
"""

def health_sql(table: str) -> str:
    """``triggerflow health``'s read of a lease table: this host's rows, newest first."""
    return f"""
SELECT id, kind, pid, expires_at > now() AS alive,
       extract(epoch FROM now() - renewed_at)::float8 AS age
FROM {table}
WHERE host = $1 AND ($2 = 'any' OR kind = $2) AND ($3::int IS NULL OR pid = $3)
ORDER BY renewed_at DESC
"""


HEALTH = health_sql("consumer")

# Queues a writer reports on (it serves them all): those consumers declare, and those with
# triggers waiting (a loose index scan of ``trigger_unclaimed``, cheap however many wait).
ALL_QUEUES = """
WITH RECURSIVE waiting(queue) AS (
    (SELECT queue FROM trigger WHERE owner_id IS NULL AND quarantined_at IS NULL
     ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM trigger t
            WHERE t.owner_id IS NULL AND t.quarantined_at IS NULL AND t.queue > w.queue
            ORDER BY t.queue LIMIT 1)
    FROM waiting w WHERE w.queue IS NOT NULL
)
SELECT queue FROM waiting WHERE queue IS NOT NULL
UNION
SELECT unnest(queues) FROM consumer WHERE kind = 'consumer'
"""

# One statement per gauge poll, per queue: live consumers by lease; those of them the broker
# should be delivering to (well below capacity: a consumer pauses its subscription at
# capacity and resumes under 90%; registered more than $2 seconds ago: it subscribes just
# after registering); deferred tasks more than 10 s past their timeout (the reaper fails
# them 2 s after it: any left mean no reaper covers the queue); and live writers, once
# (a row with a NULL queue when $1 is empty).
QUEUE_GAUGES = """
WITH w AS (SELECT count(*) AS writers FROM consumer WHERE kind = 'writer' AND expires_at > now())
SELECT q.queue, w.writers,
       -- capacity (what KEDA divides by): only consumers subscribed on the broker
       (SELECT count(*) FROM consumer c
        WHERE c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
          AND q.queue = ANY(c.queues)) AS consumers,
       (SELECT count(*) FROM consumer c
        WHERE c.kind = 'consumer' AND c.expires_at > now() AND q.queue = ANY(c.queues)
          AND c.running < c.capacity * 0.9 AND NOT c.warming
          AND c.started_at < now() - make_interval(secs => $2)) AS expected,
       (SELECT count(*) FROM task_instance ti
        WHERE ti.state = 'deferred' AND ti.trigger_timeout < now() - interval '10 seconds'
          AND ti.queue = q.queue) AS overdue
FROM w LEFT JOIN unnest($1::text[]) AS q(queue) ON true
"""

# Writers by lease, newest first: what ``status`` lists and how long ago each renewed.
STATUS_WRITERS = """
SELECT id, host, pid, version, started_at, renewed_at, expires_at > now() AS alive,
       extract(epoch FROM now() - renewed_at)::float8 AS renewed_ago,
       extract(epoch FROM now() - started_at)::float8 AS started_ago
FROM consumer WHERE kind = 'writer' ORDER BY renewed_at DESC
"""

# Trigger ids in one state, for ``requeue`` / ``unquarantine``.
TRIGGER_IDS = {
    "quarantined": "quarantined_at IS NOT NULL",
    "unclaimed": "owner_id IS NULL AND quarantined_at IS NULL",
    "dead-owner": ("owner_id IS NOT NULL AND NOT EXISTS (SELECT 1 FROM consumer c "
                   "WHERE c.id = owner_id AND c.expires_at > now())"),
    "running": ("owner_id IS NOT NULL AND EXISTS (SELECT 1 FROM consumer c "
                "WHERE c.id = owner_id AND c.expires_at > now())"),
}


def trigger_ids(state: str) -> str:
    """The statement listing ids in ``state`` ($1 = queues, or NULL for every queue)."""
    return (f"SELECT id, queue FROM trigger WHERE ({TRIGGER_IDS[state]}) "
            "AND ($1::text[] IS NULL OR queue = ANY($1::text[])) ORDER BY id")

# The reference resumer takes scheduled task instances, as a scheduler would hand them to
# workers: SKIP LOCKED so several resumers can share the work.
PICK_SCHEDULED = """
UPDATE task_instance ti SET state = 'running', updated_at = clock_timestamp()
WHERE ti.id IN (SELECT id FROM task_instance WHERE state = 'scheduled'
                ORDER BY updated_at LIMIT $1 FOR UPDATE SKIP LOCKED)
RETURNING ti.id, ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.next_method,
          ti.next_kwargs::text AS next_kwargs
"""

FINISH_TASKS = """
UPDATE task_instance ti SET state = f.state, result = f.result::jsonb,
       end_date = clock_timestamp(), updated_at = clock_timestamp()
FROM unnest($1::bigint[], $2::text[], $3::text[]) AS f(id, state, result)
WHERE ti.id = f.id AND ti.state = 'running'
"""


NATIVE_STATUS = StatusStatements(STATUS_CONSUMERS, STATUS_WRITERS, STATUS_QUEUES, STATUS_OVERDUE,
                                 QUARANTINED, HEALTH, trigger_ids=trigger_ids)
