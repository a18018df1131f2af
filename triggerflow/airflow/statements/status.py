"""What ``triggerflow status --airflow`` reads: native mode's status (``store.postgres.admin``)
on the ``triggerflow`` schema's leases and bookkeeping beside Airflow's rows.

A trigger row counts for a queue when triggerflow keeps bookkeeping for it (it published or
claimed it) or when its queue is one triggerflow serves (a consumer's, or named by
``--queue``): rows of queues Airflow's own triggerer serves are not triggerflow's to report.
Only rows with work count (a deferred task, an asset watcher, a callback: ``nontask.LIVE``);
applied rows waiting for their clean-up do not. ``$1`` is the default queue of rows with none.
"""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.store.postgres.admin import health_sql

CONSUMERS = f"""
SELECT id, kind, host, pid, queues, capacity, running, version, registered_at AS started_at,
       renewed_at, expires_at, expires_at > now() AS alive,
       cardinality(probation) AS on_probation,
       extract(epoch FROM now() - registered_at)::float8 AS started_ago, subscribed, clock_skew,
       warming,
       -- the Airflow team filter it applies (teams.py): a team, '(no team)', or NULL (none)
       CASE WHEN team_scoped THEN coalesce(team, '(no team)') END AS airflow_team
FROM {SCHEMA}.consumer ORDER BY kind, id
"""

WRITERS = f"""
SELECT id, host, pid, version, registered_at AS started_at, renewed_at,
       expires_at > now() AS alive, extract(epoch FROM now() - renewed_at)::float8 AS renewed_ago,
       extract(epoch FROM now() - registered_at)::float8 AS started_ago
FROM {SCHEMA}.consumer WHERE kind = 'writer' ORDER BY renewed_at DESC
"""

# ``triggerflow health`` without a metrics port, on triggerflow's own lease table here.
HEALTH = health_sql(f"{SCHEMA}.consumer")

# $2: the queues named by --queue (served by triggerflow even with no consumer now).
QUEUES = f"""
WITH served AS (
    SELECT unnest($2::text[]) AS queue
    UNION SELECT unnest(queues) FROM {SCHEMA}.consumer WHERE kind = 'consumer'
)
SELECT coalesce(t.queue, $1) AS queue,
       count(*) AS triggers,
       count(*) FILTER (WHERE s.owner_id IS NOT NULL) AS owned,
       count(*) FILTER (WHERE s.owner_id IS NULL AND s.quarantined_at IS NULL) AS unclaimed,
       count(*) FILTER (WHERE s.quarantined_at IS NOT NULL) AS quarantined,
       count(*) FILTER (WHERE s.owner_id IS NOT NULL AND NOT EXISTS (
           SELECT 1 FROM {SCHEMA}.consumer c
           WHERE c.id = s.owner_id AND c.expires_at > now())) AS dead_owner
FROM "trigger" t LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
WHERE coalesce(t.queue, $1) IS NOT NULL
  AND (s.trigger_id IS NOT NULL OR coalesce(t.queue, $1) IN (SELECT queue FROM served))
  AND {LIVE}
GROUP BY 1 ORDER BY 1
"""

# Airflow's scheduler fails tasks past their trigger timeout (``check_trigger_timeouts``,
# every 15 s by default): a minute past it, as the queue gauges count, means it does not.
OVERDUE = """
SELECT count(*) FROM task_instance
WHERE state = 'deferred' AND trigger_timeout < now() - interval '60 seconds'
"""

QUARANTINED = f"""
SELECT s.trigger_id AS id, coalesce(t.queue, $1) AS queue, t.classpath, s.failures,
       s.quarantined_at, s.last_error
FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id
WHERE s.quarantined_at IS NOT NULL ORDER BY s.trigger_id
"""
