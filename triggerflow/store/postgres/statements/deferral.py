"""The SDK's statements (:class:`~triggerflow.store.DeferralStore`): record deferrals, undo
one that could not be published, cancel."""

DEFER = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[], $5::text[], $6::text[],
                         $7::text[], $8::text[], $9::text[], $10::float8[], $11::text[])
        WITH ORDINALITY AS i(dag_id, task_id, run_id, map_index, classpath, kwargs, queue,
                             next_method, next_kwargs, timeout, traceparent, ord)
), ids AS MATERIALIZED (
    SELECT nextval(pg_get_serial_sequence('trigger', 'id')) AS id,
           now() + make_interval(secs => timeout) AS timeout_at, input.*
    FROM input
), new_trigger AS (
    INSERT INTO trigger (id, classpath, kwargs, queue, timeout_at, traceparent)
    SELECT id, classpath, kwargs, queue, timeout_at, traceparent FROM ids
), deferred_task AS (
    INSERT INTO task_instance AS ti (dag_id, task_id, run_id, map_index, state, queue, next_method,
                                     next_kwargs, trigger_id, trigger_timeout, start_date,
                                     updated_at)
    SELECT dag_id, task_id, run_id, map_index, 'deferred', queue, next_method, next_kwargs::jsonb,
           id, timeout_at, now(), clock_timestamp()
    FROM ids
    -- the queue is part of the key (migration 0008): a row of another team's queue never
    -- collides with this deferral, whatever key that team used first
    ON CONFLICT (dag_id, task_id, run_id, map_index, queue) DO UPDATE
    SET state = 'deferred', next_method = EXCLUDED.next_method,
        next_kwargs = EXCLUDED.next_kwargs, trigger_id = EXCLUDED.trigger_id,
        trigger_timeout = EXCLUDED.trigger_timeout, result = NULL, end_date = NULL,
        event_fired_at = NULL, event_applied_at = NULL, updated_at = EXCLUDED.updated_at
)
SELECT id FROM ids ORDER BY ord
"""

# An unroutable deferral: undo it so the caller's error is the whole truth.
UNDO_DEFER = """
WITH gone AS (DELETE FROM trigger WHERE id = ANY($1::bigint[]) AND owner_id IS NULL RETURNING id)
UPDATE task_instance SET state = 'failed', trigger_id = NULL, trigger_timeout = NULL,
       next_method = NULL, next_kwargs = jsonb_build_object('error', $2::text),
       end_date = clock_timestamp(), updated_at = clock_timestamp()
WHERE trigger_id IN (SELECT id FROM gone) AND state = 'deferred'
"""

# Cancel: the task leaves 'deferred' now; the trigger row goes at once when nobody runs it,
# else its owner cancels it (control message, or its sweep) and deletes it.
CANCEL = """
WITH target AS (
    SELECT ti.id, ti.trigger_id FROM task_instance ti
    WHERE ti.trigger_id = ANY($1::bigint[]) AND ti.state = 'deferred'
    FOR UPDATE
), moved AS (
    UPDATE task_instance ti SET state = $2, trigger_id = NULL, trigger_timeout = NULL,
           next_method = NULL, updated_at = clock_timestamp(),
           end_date = CASE WHEN $2 IN ('success', 'failed', 'skipped', 'removed')
                           THEN clock_timestamp() END
    FROM target WHERE ti.id = target.id
    RETURNING target.trigger_id
), orphan AS (
    DELETE FROM trigger t
    WHERE t.id = ANY($1::bigint[]) AND (t.owner_id IS NULL OR NOT EXISTS (
        SELECT 1 FROM consumer c WHERE c.id = t.owner_id AND c.expires_at > now()))
    RETURNING t.id, t.queue
)
SELECT t.id, t.owner_id, t.id IN (SELECT trigger_id FROM moved) AS moved, t.queue
FROM trigger t WHERE t.id = ANY($1::bigint[]) AND t.id NOT IN (SELECT id FROM orphan)
UNION ALL
SELECT id, NULL, id IN (SELECT trigger_id FROM moved), queue FROM orphan
"""
