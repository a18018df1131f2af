"""Every statement ``AirflowStore`` runs, named after what it does.

Airflow's rows (``trigger``, ``task_instance``) are read, and written only as Airflow's own
code writes them (see ``events``); leases and bookkeeping live in the ``triggerflow`` schema.
A trigger row of Airflow's has bookkeeping once triggerflow has seen it (published, claimed);
before that it is simply absent. ``$default`` parameters name the queue that rows without a
``queue`` belong to, or NULL when such rows are left to Airflow's own triggerer.
"""

from __future__ import annotations

from triggerflow.airflow.schema import SCHEMA
from triggerflow.store.postgres.statements import HELD_TAIL


def _fail_quarantined(rows: str) -> str:
    """Fail the tasks of the rows of CTE ``rows`` quarantined just now (``trigger_id``,
    ``quarantined``, ``last_error``), the way Airflow fails a trigger
    (``Trigger.submit_failure``: '__fail__', 'Trigger failure', the reason as its traceback)."""
    return f"""
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object(
            'error', 'Trigger failure',
            'traceback', jsonb_build_array(format('triggerflow quarantined this trigger: %s',
                                                  f.last_error))),
        trigger_id = NULL, scheduled_dttm = now(), updated_at = now()
    FROM {rows} f WHERE f.quarantined AND ti.trigger_id = f.trigger_id AND ti.state = 'deferred'
"""


REGISTER = f"""
INSERT INTO {SCHEMA}.consumer (kind, host, pid, queues, capacity, version, expires_at,
                      subscribed)
VALUES ($1, $2, $3, $4::text[], $5, $6, now() + make_interval(secs => $7), false)
RETURNING id
"""

RENEW = f"""
UPDATE {SCHEMA}.consumer SET renewed_at = now(),
       expires_at = now() + make_interval(secs => $2), running = $3, subscribed = $5,
       clock_skew = $6  -- as native mode's RENEW
WHERE id = $1 AND expires_at > now()
RETURNING
    extract(epoch FROM clock_timestamp())::float8 AS db_time,
    (SELECT count(*) FROM {SCHEMA}.consumer c
     WHERE c.expires_at <= now() AND (c.queues && $4::text[] OR cardinality($4::text[]) = 0))
        AS dead_peers,
    (SELECT count(*) FROM {SCHEMA}.consumer c
     WHERE c.kind = 'consumer' AND c.expires_at > now()
       AND CASE WHEN c.id = $1 THEN $5 ELSE c.subscribed END  -- as native mode's RENEW
       AND c.queues @> $4::text[] AND c.queues <@ $4::text[]) AS live_peers,
    -- my own row as this renewal writes it: subqueries of RETURNING see it as it was
    -- (0 right after a claim of thousands made me shed them all to a peer with none)
    (SELECT coalesce(sum(CASE WHEN c.id = $1 THEN $3 ELSE c.running END), 0)
     FROM {SCHEMA}.consumer c
     WHERE c.kind = 'consumer' AND c.expires_at > now()
       AND CASE WHEN c.id = $1 THEN $5 ELSE c.subscribed END
       AND c.queues @> $4::text[] AND c.queues <@ $4::text[]) AS peers_running
"""

# as the native statements of the same names (triggerflow/store/postgres/statements.py)
ANNOUNCE_PRESENCE = f"UPDATE {SCHEMA}.consumer SET presence = $2 WHERE id = $1 RETURNING id"

PRESENCE_GONE = f"""
UPDATE {SCHEMA}.consumer SET expires_at = now(), renewed_at = now() - (expires_at - renewed_at)
WHERE presence = $1 AND kind = 'consumer' AND expires_at > now() AND queues && $2::text[]
RETURNING id
"""

UNREGISTER = f"""
WITH stragglers AS (
    UPDATE {SCHEMA}.trigger_state SET owner_id = NULL, published_at = now() - interval '1 day'
    WHERE owner_id = $1 RETURNING trigger_id
)
DELETE FROM {SCHEMA}.consumer WHERE id = $1
"""

# What a consumer needs to run a claimed trigger: Airflow's classpath and encrypted kwargs,
# the team queue, the task for log lines, and how long ago the task deferred (the API server
# writes created_date with the deferral: the scheduler race's clock). Timeouts stay the
# scheduler's (as in Airflow).
_SPEC = """
    t.id, c.attempt, t.classpath, t.kwargs, coalesce(t.queue, $4) AS queue,
    format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) AS task,
    extract(epoch FROM clock_timestamp() - t.created_date)::float8 AS deferred_for
"""

# One statement: Airflow's trigger rows of my queues that a deferred task waits on, joined
# with triggerflow's bookkeeping (absent the first time), claimed where no live owner holds
# them. The upsert takes the bookkeeping row's lock: a concurrent claim of the same id waits,
# then finds a live owner and claims nothing. Asset-watcher and callback triggers have no
# deferred task and are never claimed here.
CLAIM = f"""
WITH candidate AS (
    SELECT t.id, coalesce(t.queue, $4) AS queue, coalesce(s.failures, 0) AS failures,
           coalesce($1 = ANY(s.rejected_by), false) AS refused, s.owner_id IS NULL AS unowned
    FROM "trigger" t
    LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
    WHERE t.id = ANY($2::int[]) AND coalesce(t.queue, $4) = ANY($3::text[])
      AND s.quarantined_at IS NULL
      -- held by a live owner: not mine, not a suspect waiting for probation (as native)
      AND (s.owner_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM {SCHEMA}.consumer o WHERE o.id = s.owner_id AND o.expires_at > now()))
      -- coalesce(): found by ti_trigger_id, never by the ti_state index (see events.APPLY)
      AND EXISTS (SELECT 1 FROM task_instance ti
                  WHERE ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred')
), claimed AS (
    INSERT INTO {SCHEMA}.trigger_state AS s (trigger_id, owner_id, attempt, claimed_at)
    SELECT id, $1, 1, now() FROM candidate WHERE failures < 2 AND NOT refused ORDER BY id
    ON CONFLICT (trigger_id) DO UPDATE
        SET owner_id = $1, attempt = s.attempt + 1, claimed_at = now()
        WHERE s.quarantined_at IS NULL AND s.failures < 2 AND NOT ($1 = ANY(s.rejected_by))
          AND (s.owner_id IS NULL OR NOT EXISTS (
                SELECT 1 FROM {SCHEMA}.consumer o
                WHERE o.id = s.owner_id AND o.expires_at > now()))
    RETURNING s.trigger_id, s.attempt
)
SELECT {_SPEC}, 'claimed' AS outcome
FROM claimed c JOIN "trigger" t ON t.id = c.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred'
UNION ALL
SELECT id, 0, '', '', queue, NULL, NULL, 'suspect' FROM candidate
WHERE failures >= 2 AND NOT refused
UNION ALL
SELECT id, 0, '', '', queue, NULL, NULL, 'refused' FROM candidate WHERE refused AND unowned
"""

CLAIM_PROBATION = f"""
WITH worst AS (
    SELECT s.failures AS f, count(*) AS n
    FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id
    WHERE coalesce(t.queue, $3) = ANY($2::text[]) AND s.owner_id IS NULL
      AND s.quarantined_at IS NULL AND s.failures >= 2
    GROUP BY s.failures ORDER BY s.failures DESC LIMIT 1
), candidate AS (
    SELECT s.trigger_id FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id,
         worst
    WHERE coalesce(t.queue, $3) = ANY($2::text[]) AND s.owner_id IS NULL
      AND s.quarantined_at IS NULL AND s.failures = worst.f AND NOT ($1 = ANY(s.rejected_by))
    ORDER BY s.trigger_id
    LIMIT (SELECT least(greatest(1, (n + 1) / 2), $4::int) FROM worst)
    FOR UPDATE OF s SKIP LOCKED
), claimed AS (
    UPDATE {SCHEMA}.trigger_state s SET owner_id = $1, attempt = s.attempt + 1,
           claimed_at = now()
    FROM candidate WHERE s.trigger_id = candidate.trigger_id
    RETURNING s.trigger_id, s.attempt
), on_probation AS (
    UPDATE {SCHEMA}.consumer
    SET probation = (SELECT coalesce(array_agg(trigger_id), '{{}}') FROM claimed)
    WHERE id = $1
)
SELECT t.id, c.attempt, t.classpath, t.kwargs, coalesce(t.queue, $3) AS queue,
       format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) AS task,
       extract(epoch FROM clock_timestamp() - t.created_date)::float8 AS deferred_for
FROM claimed c JOIN "trigger" t ON t.id = c.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND ti.state = 'deferred'
"""

CLEAR_PROBATION = f"""
WITH cleared AS (
    UPDATE {SCHEMA}.trigger_state SET failures = 0
    WHERE trigger_id = ANY($2::int[]) AND owner_id = $1 RETURNING trigger_id
)
UPDATE {SCHEMA}.consumer SET probation = '{{}}' WHERE id = $1
"""

RELEASE = f"""
UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, published_at = now(),
       rejected_by = CASE WHEN $3 THEN s.rejected_by || $1::bigint ELSE s.rejected_by END,
       last_error = coalesce($4, s.last_error)
FROM "trigger" t
WHERE t.id = s.trigger_id AND s.owner_id = $1
  AND ($2::int[] IS NULL OR s.trigger_id = ANY($2::int[]))
RETURNING s.trigger_id AS id, coalesce(t.queue, $5) AS queue
"""

# Reconcile: rows I fired but still own at that attempt lost their event; free them.
RELEASE_LOST = f"""
UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, published_at = now()
FROM "trigger" t, unnest($2::int[], $3::int[]) AS lost(id, attempt)
WHERE t.id = s.trigger_id AND s.trigger_id = lost.id AND s.attempt = lost.attempt
  AND s.owner_id = $1
RETURNING s.trigger_id AS id, coalesce(t.queue, $4) AS queue
"""

# Refused triggers no other live consumer may load: fail their tasks naming the class.
FAIL_UNLOADABLE = f"""
WITH gone AS (
    DELETE FROM {SCHEMA}.trigger_state s USING "trigger" t
    WHERE t.id = s.trigger_id AND s.trigger_id = ANY($1::int[]) AND s.owner_id IS NULL
      AND $2::bigint = ANY(s.rejected_by)
      AND NOT EXISTS (
          SELECT 1 FROM {SCHEMA}.consumer c
          WHERE c.kind = 'consumer' AND c.expires_at > now()
            AND coalesce(t.queue, $3) = ANY(c.queues) AND NOT (c.id = ANY(s.rejected_by)))
    RETURNING s.trigger_id, t.classpath, coalesce(t.queue, $3) AS queue, s.last_error
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object(
            'error', 'Trigger failure',
            'traceback', jsonb_build_array(format(
                'triggerflow: no live consumer of queue %s can load %s (%s)',
                g.queue, g.classpath, coalesce(g.last_error, 'unknown')))),
        trigger_id = NULL, scheduled_dttm = now(), updated_at = now()
    FROM gone g WHERE ti.trigger_id = g.trigger_id AND ti.state = 'deferred'
)
SELECT trigger_id AS id FROM gone
"""

OTHER_LOADERS = f"""
SELECT count(*) FROM {SCHEMA}.consumer c, "trigger" t
LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
WHERE t.id = $1 AND c.kind = 'consumer' AND c.expires_at > now()
  AND coalesce(t.queue, $3) = ANY(c.queues)
  AND NOT (c.id = ANY(coalesce(s.rejected_by, '{{}}'))) AND c.id <> $2
"""

# Backstop for cancellation: triggers I hold whose task is no longer deferred on them (a task
# cleared or marked by hand, or timed out by Airflow's scheduler).
SWEEP_CANCELLED = f"""
DELETE FROM {SCHEMA}.trigger_state s
WHERE s.owner_id = $1 AND NOT EXISTS (
    SELECT 1 FROM task_instance ti WHERE ti.trigger_id = s.trigger_id AND ti.state = 'deferred')
RETURNING s.trigger_id AS id
"""

FORGET_HELD = f"""
DELETE FROM {SCHEMA}.trigger_state WHERE trigger_id = ANY($1::int[]) AND owner_id = $2
"""

# A strike against a trigger that blocked my event loop, by (id, attempt) as the native
# STRIKE (why it needs no live lease is said there); quarantined as REAP_DEAD quarantines.
STRIKE = f"""
WITH struck AS (
    UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, attempt = s.attempt + 1,
        published_at = now(), failures = s.failures + 1,
        quarantined_at = CASE WHEN s.failures + 1 >= $5 THEN now() END,
        last_error = format('trigger %s (%s) blocked the event loop for %s s on consumer %s '
                            '(%s failures)', t.id, t.classpath, round($4::numeric, 1), $1,
                            s.failures + 1)
    FROM "trigger" t
    WHERE t.id = s.trigger_id AND s.trigger_id = $2 AND s.attempt = $3
      AND (s.owner_id = $1 OR s.owner_id IS NULL) AND s.quarantined_at IS NULL
    RETURNING s.trigger_id, coalesce(t.queue, $6) AS queue, t.classpath, s.failures,
              s.quarantined_at IS NOT NULL AS quarantined, s.last_error
), failed AS ({_fail_quarantined("struck")})
SELECT trigger_id AS id, queue, classpath, failures, quarantined FROM struck
"""

# Consumers whose lease expired: free their triggers for re-sending, blaming as probation
# says. A quarantined trigger's task fails the way Airflow fails a trigger
# (``Trigger.submit_failure``: '__fail__', 'Trigger failure', the reason as its traceback).
REAP_DEAD = f"""
WITH dead AS (
    -- witnessed: another process with a lease no longer than this one's stayed valid across
    -- its expiry (so the database took writes then); else an outage: no trigger to blame
    SELECT d.id, d.probation, EXISTS (
               SELECT 1 FROM {SCHEMA}.consumer w
               WHERE w.id <> d.id AND w.expires_at > now() AND w.registered_at < d.expires_at
                 AND w.expires_at - w.renewed_at <= d.expires_at - d.renewed_at
           ) AS witnessed
    FROM {SCHEMA}.consumer d
    WHERE d.expires_at < now() AND (d.queues && $1::text[] OR $2)
    FOR UPDATE OF d SKIP LOCKED
), blamed AS (
    SELECT s.trigger_id, s.owner_id,
           d.witnessed AND (cardinality(d.probation) = 0 OR s.trigger_id = ANY(d.probation))
               AS blame,
           d.probation = ARRAY[s.trigger_id::bigint] AS alone
    FROM {SCHEMA}.trigger_state s JOIN dead d ON s.owner_id = d.id
), freed AS (
    UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, published_at = now(),
        failures = s.failures + b.blame::int,
        quarantined_at = CASE WHEN b.blame AND (b.alone OR s.failures + 1 >= $3) THEN now() END,
        last_error = CASE WHEN b.blame
            THEN format('consumer %s died while running it (%s ungraceful losses)',
                        b.owner_id, s.failures + 1)
            ELSE s.last_error END
    -- only while the dead consumer still owns it: a claim that committed while this waited
    -- on the row is re-checked here (READ COMMITTED) and stands
    FROM blamed b WHERE s.trigger_id = b.trigger_id AND s.owner_id = b.owner_id
    RETURNING s.trigger_id, s.failures, s.quarantined_at IS NOT NULL AS quarantined, s.last_error
), failed AS ({_fail_quarantined("freed")}), gone AS (
    DELETE FROM {SCHEMA}.consumer WHERE id IN (SELECT id FROM dead) RETURNING id
)
SELECT f.trigger_id AS id, coalesce(t.queue, $4) AS queue, t.classpath, f.failures,
       f.quarantined, (SELECT count(*) FROM gone) AS dead
FROM freed f JOIN "trigger" t ON t.id = f.trigger_id
"""

# The backstop for wake-ups: Airflow trigger rows of a deferred task that nobody owns and that
# were not published within the grace period (including rows never seen: inserted while no
# listener was connected). Marks them published and returns them to re-send.
RESEND_UNCLAIMED = f"""
WITH due AS (
    SELECT t.id, coalesce(t.queue, $5) AS queue
    FROM "trigger" t
    LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
    WHERE (s.trigger_id IS NULL OR (s.owner_id IS NULL AND s.quarantined_at IS NULL
                                    AND coalesce(s.published_at, '-infinity') <
                                        now() - make_interval(secs => $3)))
      AND t.created_date < now() - make_interval(secs => $3)
      AND coalesce(t.queue, $5) IS NOT NULL
      AND (coalesce(t.queue, $5) = ANY($1::text[]) OR $2)
      AND EXISTS (SELECT 1 FROM task_instance ti
                  WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
    ORDER BY t.id
    LIMIT $4
), marked AS (
    INSERT INTO {SCHEMA}.trigger_state AS s (trigger_id, published_at)
    SELECT id, now() FROM due
    ON CONFLICT (trigger_id) DO UPDATE SET published_at = now() WHERE s.owner_id IS NULL
    RETURNING s.trigger_id
)
SELECT due.id, due.queue FROM due JOIN marked ON marked.trigger_id = due.id
"""

# Wake-ups published by the NOTIFY listener: remember when, so the backstop leaves them be.
MARK_PUBLISHED = f"""
INSERT INTO {SCHEMA}.trigger_state AS s (trigger_id, published_at)
SELECT unnest($1::int[]), now()
ON CONFLICT (trigger_id) DO UPDATE SET published_at = now() WHERE s.owner_id IS NULL
"""

WAITING_QUEUES = f"""
SELECT DISTINCT coalesce(t.queue, $2) AS queue
FROM "trigger" t LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
WHERE coalesce(t.queue, $2) IS NOT NULL AND s.owner_id IS NULL AND s.quarantined_at IS NULL
  AND coalesce(s.published_at, t.created_date) < now() - make_interval(secs => $1)
  AND EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
"""

QUEUE_CONSUMERS = f"""
SELECT q, count(c.id) AS consumers
FROM unnest($1::text[]) AS q
LEFT JOIN {SCHEMA}.consumer c ON c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
    AND q = ANY(c.queues)
GROUP BY q
"""

# The queue gauges' statements, as native mode's (store/postgres/admin.py) on this schema:
# $1 queues, $2 seconds a consumer may take to subscribe, $3 the default queue. Overdue counts
# deferred tasks a minute past their timeout: Airflow's scheduler fails them
# (``check_trigger_timeouts``, every 15 s by default), so any left mean it does not.
QUEUE_GAUGES = f"""
WITH w AS (SELECT count(*) AS writers FROM {SCHEMA}.consumer
           WHERE kind = 'writer' AND expires_at > now())
SELECT q.queue, w.writers,
       (SELECT count(*) FROM {SCHEMA}.consumer c
        WHERE c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
          AND q.queue = ANY(c.queues)) AS consumers,
       (SELECT count(*) FROM {SCHEMA}.consumer c
        WHERE c.kind = 'consumer' AND c.expires_at > now() AND q.queue = ANY(c.queues)
          AND c.running < c.capacity * 0.9
          AND c.registered_at < now() - make_interval(secs => $2)) AS expected,
       (SELECT count(*) FROM task_instance ti JOIN "trigger" t ON t.id = ti.trigger_id
        WHERE ti.state = 'deferred' AND ti.trigger_timeout < now() - interval '60 seconds'
          AND coalesce(t.queue, $3) = q.queue) AS overdue
FROM w LEFT JOIN unnest($1::text[]) AS q(queue) ON true
"""

# Queues a writer reports on: those with a deferred task's trigger nobody owns, and those
# consumers declare. $1: the default queue.
GAUGE_QUEUES = f"""
SELECT DISTINCT coalesce(t.queue, $1) AS queue
FROM "trigger" t LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
WHERE coalesce(t.queue, $1) IS NOT NULL AND s.owner_id IS NULL AND s.quarantined_at IS NULL
  AND EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
UNION
SELECT unnest(queues) FROM {SCHEMA}.consumer WHERE kind = 'consumer'
"""

# Trigger.clean_unused, whole-table, as Airflow's triggerer runs it each loop (the writer's
# reaper runs it here, far less often): tasks no longer deferred let go of their trigger, then
# rows nothing refers to are deleted, with their bookkeeping.
DETACH_FINISHED = """
UPDATE task_instance SET trigger_id = NULL, updated_at = now()
WHERE state <> 'deferred' AND trigger_id IS NOT NULL
"""

DELETE_UNUSED = f"""
WITH gone AS (
    DELETE FROM "trigger" t
    WHERE NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM callback cb WHERE cb.trigger_id = t.id)
    RETURNING t.id
), bookkeeping AS (
    DELETE FROM {SCHEMA}.trigger_state s
    WHERE s.trigger_id IN (SELECT id FROM gone)
       OR NOT EXISTS (SELECT 1 FROM "trigger" t WHERE t.id = s.trigger_id)
)
SELECT count(*) FROM gone
"""

# The Airflow twin of the native HELD_ELSEWHERE (run before events.APPLY in one transaction):
# locks the bookkeeping and task rows no other transaction holds, SKIP LOCKED, and returns
# the events whose rows are held elsewhere, for the writer to retry later.
HELD_ELSEWHERE = f"""
WITH ev AS (
    SELECT * FROM unnest($1::int[], $2::int[], $3::text[]) AS e(trigger_id, attempt, queue)
), matching AS MATERIALIZED (
    SELECT s.trigger_id AS id FROM ev
    JOIN {SCHEMA}.trigger_state s ON s.trigger_id = ev.trigger_id AND s.attempt = ev.attempt
    JOIN "trigger" t ON t.id = ev.trigger_id AND coalesce(t.queue, $4) = ev.queue
), got_row AS MATERIALIZED (
    SELECT s.trigger_id AS id FROM {SCHEMA}.trigger_state s
    WHERE s.trigger_id IN (SELECT id FROM matching)
    FOR UPDATE SKIP LOCKED
)""" + HELD_TAIL
