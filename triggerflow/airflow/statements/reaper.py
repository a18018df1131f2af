"""The reaper's and the backstop's statements in Airflow mode
(:class:`~triggerflow.store.ReaperStore`, and ``Trigger.clean_unused``)."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.statements.claims import SPEC, fail_quarantined
from triggerflow.airflow.teams import in_team
from triggerflow.store.interface import SUSPECT_FAILURES
from triggerflow.store.postgres.statements.reaper import blame_columns, stalled, take_or_free

# Consumers whose lease expired: blame as the native REAP_DEAD does (a known loop-blocker it
# held alone, else as probation says; $7 blocked runs quarantine a blocker), then take over
# (a reaping consumer, $5, with room for $6) or free for re-sending. A quarantined trigger's
# task fails the way Airflow fails a trigger (``Trigger.submit_failure``: '__fail__',
# 'Trigger failure', the reason as its traceback). Taken: of the reaper's queues ($1), with work (LIVE), not a
# suspect even after this death, not refused by the taker, within its room; owned by it at a
# raised attempt in this same rewrite, as a claim would leave it (one rewrite, not two).
# A consumer of an Airflow team ($8, teams.py) reaps only consumers of its team and takes only
# rows of its team.
REAP_DEAD = f"""
WITH dead AS (
    -- witnessed: another process with a lease no longer than this one's stayed valid across
    -- its expiry (so the database took writes then); else an outage: no trigger to blame
    SELECT d.id, d.probation, EXISTS (
               SELECT 1 FROM {SCHEMA}.consumer w
               WHERE w.id <> d.id AND w.expires_at > now() AND w.registered_at < d.expires_at
                 AND w.expires_at - w.renewed_at <= d.expires_at - d.renewed_at
           ) AS witnessed,
           {stalled(f"{SCHEMA}.trigger_state")}
    FROM {SCHEMA}.consumer d
    WHERE d.expires_at < now() AND (d.queues && $1::text[] OR $2) AND {in_team("d.team", 8)}
    FOR UPDATE OF d SKIP LOCKED
), blamed AS (
    SELECT s.trigger_id, s.owner_id, s.failures, s.rejected_by,
           {blame_columns("s", "s.trigger_id")}
    FROM {SCHEMA}.trigger_state s JOIN dead d ON s.owner_id = d.id
), judged AS (
    SELECT b.trigger_id, b.owner_id, b.blame, b.blame AND b.blocker AS block, t.classpath,
           b.blame AND CASE WHEN b.blocker THEN b.blocks >= $7
                            ELSE b.alone OR b.failures + 1 >= $3 END AS quarantine,
           coalesce($5::bigint IS NOT NULL AND coalesce(t.queue, $4) = ANY($1::text[])
               AND b.failures + (b.blame AND NOT b.blocker)::int < {SUSPECT_FAILURES}
               AND NOT coalesce($5::bigint = ANY(b.rejected_by), false)
               AND {LIVE} AND {in_team("t.team_name", 8)},
               false) AS takeable  -- never NULL: it sets the attempt
    FROM blamed b JOIN "trigger" t ON t.id = b.trigger_id
), fate AS (
    SELECT j.*, j.takeable AND NOT j.quarantine
               AND row_number() OVER (PARTITION BY j.takeable ORDER BY j.trigger_id) <= $6 AS take
    FROM judged j
), freed AS (
    UPDATE {SCHEMA}.trigger_state s SET {take_or_free(
        "s", "published_at", "format('trigger %s (%s) ', f.trigger_id, f.classpath)")}
    -- only while the dead consumer still owns it: a claim that committed while this waited
    -- on the row is re-checked here (READ COMMITTED) and stands
    FROM fate f WHERE s.trigger_id = f.trigger_id AND s.owner_id = f.owner_id
    RETURNING s.trigger_id, s.attempt, s.failures, s.quarantined_at IS NOT NULL AS quarantined,
              s.last_error, f.take
), failed AS ({fail_quarantined("freed")}), gone AS (
    DELETE FROM {SCHEMA}.consumer WHERE id IN (SELECT id FROM dead) RETURNING id
)
SELECT {SPEC.replace("c.attempt", "f.attempt")}, f.failures,
       f.quarantined, f.take AS taken, (SELECT count(*) FROM gone) AS dead
FROM freed f JOIN "trigger" t ON t.id = f.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred'
"""

# The backstop for wake-ups: Airflow trigger rows of a deferred task that nobody owns and that
# were not published within the grace period (including rows never seen: inserted while no
# listener was connected). Marks them published and returns them to re-send. A consumer of an
# Airflow team ($6, teams.py) re-sends only rows of its team.
RESEND_UNCLAIMED = f"""
WITH due AS (
    SELECT t.id, coalesce(t.queue, $5) AS queue
    FROM "trigger" t
    LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
    WHERE (s.trigger_id IS NULL OR (s.owner_id IS NULL AND s.quarantined_at IS NULL
                                    AND coalesce(s.published_at, '-infinity') <
                                        now() - make_interval(secs => $3)))
      -- a row never published waits the grace from its deferral (the NOTIFY listener
      -- publishes it); one published or dated back (unregister) only from that
      AND (s.published_at IS NOT NULL OR t.created_date < now() - make_interval(secs => $3))
      AND coalesce(t.queue, $5) IS NOT NULL
      AND (coalesce(t.queue, $5) = ANY($1::text[]) OR $2)
      AND {LIVE} AND {in_team("t.team_name", 6)}
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
