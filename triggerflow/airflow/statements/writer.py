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
    SELECT s.trigger_id AS id FROM ev
    JOIN {SCHEMA}.trigger_state s ON s.trigger_id = ev.trigger_id AND s.attempt = ev.attempt
    JOIN "trigger" t ON t.id = ev.trigger_id AND coalesce(t.queue, $4) = ev.queue
), got_row AS MATERIALIZED (
    SELECT s.trigger_id AS id FROM {SCHEMA}.trigger_state s
    WHERE s.trigger_id IN (SELECT id FROM matching)
    FOR UPDATE SKIP LOCKED
)"""
    + HELD_TAIL
)
