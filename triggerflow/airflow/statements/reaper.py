"""The reaper's and the backstop's statements in Airflow mode
(:class:`~triggerflow.store.ReaperStore`, and ``Trigger.clean_unused``)."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.statements.bookkeeping import AIRFLOW
from triggerflow.airflow.teams import in_team
from triggerflow.store.postgres.statements import ownership

REAP_DEAD = AIRFLOW.render(ownership.REAP_DEAD)

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

QUEUE_CONSUMERS = AIRFLOW.render(ownership.QUEUE_CONSUMERS)


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
