"""The writer's statements (:class:`~triggerflow.store.EventStore`): apply events, fenced."""

from triggerflow.model import FAIL_METHOD
from triggerflow.store.postgres.statements import ownership
from triggerflow.store.postgres.statements.bookkeeping import NATIVE

# One statement per batch: delete the named triggers, only at the current attempt and of
# the event's own queue (fencing), and move each task that is still deferred on one of them.
APPLY_EVENTS = f"""
WITH ev AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[], $4::text[], $5::text[],
                         $6::float8[])
        AS e(trigger_id, attempt, queue, kind, payload, fired_at)
    -- only the project's kinds: anything else would become the task's state below
    WHERE e.kind IN ('resume', 'fail', 'success', 'failed', 'skipped')
), finished AS (
    -- fenced by attempt and queue in the DELETE itself: a row a claim changed meanwhile is
    -- re-checked after its lock and skipped. The ids come sorted (the writer sorts them), so
    -- concurrent batches lock in id order; a deadlock all the same is retried. A separate
    -- FOR UPDATE pass cost ~7% of the statement (5,000 events: 88 ms, 82 ms without).
    -- The event travels with its trigger: no later join against ev, which a generic plan
    -- (unnest estimated at 10 rows) runs as a nested loop, N x N comparisons
    DELETE FROM trigger t USING ev
    WHERE t.id = ev.trigger_id AND t.attempt = ev.attempt AND t.queue = ev.queue
    RETURNING t.id, ev.queue, ev.kind, ev.payload, ev.fired_at
), target AS MATERIALIZED (
    -- found by ti_trigger alone: with a state predicate here the planner may AND in the
    -- partial index of every deferred task (ti_deferred_timeout) once per event
    SELECT ti.id AS ti_id, f.* FROM finished f JOIN task_instance ti ON ti.trigger_id = f.id
), moved AS (
    UPDATE task_instance ti SET
        state = CASE WHEN e.kind IN ('resume', 'fail') THEN 'scheduled' ELSE e.kind END,
        next_method = CASE e.kind WHEN 'resume' THEN ti.next_method
                                  WHEN 'fail' THEN '{FAIL_METHOD}' END,
        next_kwargs = CASE e.kind
            WHEN 'resume' THEN coalesce(ti.next_kwargs, '{{}}'::jsonb)
                               || jsonb_build_object('event', e.payload::jsonb)
            WHEN 'fail' THEN e.payload::jsonb END,
        result = CASE WHEN e.kind IN ('success', 'failed', 'skipped') THEN e.payload::jsonb
                      ELSE ti.result END,
        end_date = CASE WHEN e.kind IN ('success', 'failed', 'skipped') THEN clock_timestamp()
                        ELSE ti.end_date END,
        trigger_id = NULL, trigger_timeout = NULL,
        event_fired_at = to_timestamp(e.fired_at), event_applied_at = clock_timestamp(),
        updated_at = clock_timestamp()
    FROM target e
    -- coalesce(): keeps the planner off ti_deferred_timeout (the partial index of every
    -- deferred task). With no statistics since a wave of deferrals it guessed two deferred
    -- rows, materialized the whole index and compared each event with each row (N x M:
    -- 119,900 comparisons for 200 events beside 500 waiting); the task is found by its key.
    WHERE ti.id = e.ti_id AND ti.trigger_id = e.id AND coalesce(ti.state, '') = 'deferred'
    RETURNING e.kind, e.queue, extract(epoch FROM clock_timestamp()) - e.fired_at AS latency
)
SELECT kind, queue, latency FROM moved
"""

HELD_ELSEWHERE = NATIVE.render(ownership.HELD_ELSEWHERE)
