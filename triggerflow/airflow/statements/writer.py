"""The writer's statement in Airflow mode beside ``airflow.events.APPLY``
(:class:`~triggerflow.store.EventStore`)."""

from triggerflow.airflow.schema import SCHEMA
from triggerflow.store.postgres.statements.writer import HELD_TAIL

# The Airflow twin of the native HELD_ELSEWHERE (run before events.APPLY in one transaction):
# locks the bookkeeping and task rows no other transaction holds, SKIP LOCKED, and returns
# the events whose rows are held elsewhere, for the writer to retry later.
HELD_ELSEWHERE = (
    f"""
WITH ev AS (
    SELECT * FROM unnest($1::int[], $2::int[], $3::text[]) AS e(trigger_id, attempt, queue)
), matching AS MATERIALIZED (
    -- each event's rows by its own index lookups (OFFSET 0 keeps the subquery one), as in
    -- claims.CLAIM and events.APPLY: whatever the statistics of the emptied trigger tables
    SELECT m.id FROM ev CROSS JOIN LATERAL (
        SELECT s.trigger_id AS id FROM {SCHEMA}.trigger_state s
        WHERE s.trigger_id = ev.trigger_id AND s.attempt = ev.attempt
          AND (SELECT coalesce(t.queue, $4) FROM "trigger" t WHERE t.id = ev.trigger_id)
              = ev.queue
        OFFSET 0
    ) AS m
), got_row AS MATERIALIZED (
    SELECT g.id FROM matching CROSS JOIN LATERAL (
        SELECT s.trigger_id AS id FROM {SCHEMA}.trigger_state s
        WHERE s.trigger_id = matching.id
        FOR UPDATE SKIP LOCKED
    ) AS g
)"""
    + HELD_TAIL
)
