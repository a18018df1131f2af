"""The reaper's statements (:class:`~triggerflow.store.ReaperStore`): dead owners' triggers,
lost wake-ups, orphaned tasks, waiting queues."""

from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store.interface import ORPHAN_SLACK
from triggerflow.store.postgres.statements import ownership
from triggerflow.store.postgres.statements.bookkeeping import NATIVE

REAP_DEAD = NATIVE.render(ownership.REAP_DEAD)

# Just quarantined (REAP_DEAD, STRIKE) with no task pointing at it: a row its task left when
# it deferred again, or the spare of a deferral retried after a lost commit reply. Nothing
# waits on it and there is nothing to release: it goes, instead of staying as a quarantined
# row that names no task (Airflow mode: Airflow's ``clean_unused`` drops such a row).
DROP_UNWAITED = """
DELETE FROM trigger t
WHERE t.id = ANY($1::bigint[]) AND t.quarantined_at IS NOT NULL
  AND NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id)
"""

# Triggers nobody claimed within the grace period (a publish lost after commit, a consumer
# that acked and died before claiming): mark them dispatched again and return them to re-send.
RESEND_UNCLAIMED = """
WITH due AS (
    SELECT id FROM trigger
    WHERE owner_id IS NULL AND quarantined_at IS NULL
      AND dispatched_at < now() - make_interval(secs => $3)
      AND (queue = ANY($1::text[]) OR $2)
    ORDER BY dispatched_at
    LIMIT $4
    FOR UPDATE SKIP LOCKED
)
UPDATE trigger t SET dispatched_at = now() FROM due WHERE t.id = due.id
RETURNING t.id, t.queue
"""

# Deferred tasks past their timeout (or, without one, the maximum deferral with their trigger
# on no live consumer): fail them the Airflow way and drop the trigger. Nothing lost between
# the consumer, the broker and the writer can keep a task deferred past this.
# Each half is found by its own partial index (ti_deferred_timeout, ti_deferred_untimed):
# one OR over both let the planner walk every deferred task in id order, each reaper pass.
TIMEOUT_ORPHANS = f"""
WITH due AS (
    SELECT ti.id, ti.trigger_id FROM task_instance ti
    WHERE ti.id IN (
        SELECT id FROM task_instance
        WHERE state = 'deferred' AND trigger_timeout < now() - interval '{ORPHAN_SLACK} seconds'
        UNION ALL
        SELECT id FROM task_instance
        WHERE state = 'deferred' AND trigger_timeout IS NULL
          AND updated_at < now() - make_interval(secs => $3))
      AND ti.state = 'deferred'
      -- past its timeout it is due whoever owns it: a live owner that still runs the
      -- trigger times it out itself at trigger_timeout, so one that has not is not running it
      AND (ti.trigger_timeout < now() - interval '{ORPHAN_SLACK} seconds'
           OR (ti.trigger_timeout IS NULL AND ti.updated_at < now() - make_interval(secs => $3)
               AND NOT EXISTS (
                   SELECT 1 FROM trigger t JOIN consumer c ON c.id = t.owner_id
                   WHERE t.id = ti.trigger_id AND c.expires_at > now())))
      AND (ti.queue = ANY($1::text[]) OR $2)
    ORDER BY ti.id
    LIMIT 10000
    FOR UPDATE OF ti SKIP LOCKED
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object('error', '{FailureReason.TRIGGER_TIMEOUT}',
                                         'message', 'deferral timed out with no trigger running'),
        trigger_id = NULL, trigger_timeout = NULL, updated_at = clock_timestamp()
    FROM due WHERE ti.id = due.id AND ti.id = ANY(ARRAY(SELECT id FROM due))
    RETURNING due.trigger_id
)
DELETE FROM trigger WHERE id IN (SELECT trigger_id FROM failed) RETURNING id, queue
"""

# Queues with triggers waiting past the grace period (the writer's reaper checks them all).
# Queues with a trigger unclaimed past the grace: a skip scan of trigger_unclaimed (queue,
# dispatched_at), one index probe per distinct queue and one for its oldest entry, where a
# DISTINCT read the whole backlog.
WAITING_QUEUES = """
WITH RECURSIVE q(queue) AS (
    (SELECT queue FROM trigger WHERE owner_id IS NULL AND quarantined_at IS NULL
     ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM trigger t
            WHERE t.owner_id IS NULL AND t.quarantined_at IS NULL AND t.queue > q.queue
            ORDER BY t.queue LIMIT 1)
    FROM q WHERE q.queue IS NOT NULL
)
SELECT queue FROM q
WHERE queue IS NOT NULL AND (
    SELECT min(t.dispatched_at) FROM trigger t
    WHERE t.owner_id IS NULL AND t.quarantined_at IS NULL AND t.queue = q.queue
) < now() - make_interval(secs => $1)
"""

QUEUE_CONSUMERS = NATIVE.render(ownership.QUEUE_CONSUMERS)
