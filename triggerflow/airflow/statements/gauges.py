"""The queue gauges' statements in Airflow mode (``AirflowMode.connect_gauges``)."""

from triggerflow.airflow.schema import SCHEMA

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
          AND c.running < c.capacity * 0.9 AND NOT c.warming
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
