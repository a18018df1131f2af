"""The reaper's and the backstop's statements in Airflow mode
(:class:`~triggerflow.store.ReaperStore`, and ``Trigger.clean_unused``)."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.statements.claims import fail_quarantined

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
), failed AS ({fail_quarantined("freed")}), gone AS (
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
      AND {LIVE}
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
  AND {LIVE}
"""

QUEUE_CONSUMERS = f"""
SELECT q, count(c.id) AS consumers
FROM unnest($1::text[]) AS q
LEFT JOIN {SCHEMA}.consumer c ON c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
    AND q = ANY(c.queues)
GROUP BY q
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
