"""The reaper's statements (:class:`~triggerflow.store.ReaperStore`): dead owners' triggers,
lost wake-ups, orphaned tasks, waiting queues."""

from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store.interface import ORPHAN_SLACK, SUSPECT_FAILURES


def take_or_free(row: str, sent: str, named: str = "''") -> str:
    """The SET list of a reaping rewrite of ``row`` by CTE row ``f`` (``take``, ``blame``,
    ``block``, ``quarantine``, ``owner_id``): taken by the reaping consumer $5 at a raised
    attempt, or freed; blamed and quarantined as ``f`` says, a blamed known loop-blocker
    (``block``) by counting the run it blocked instead of a loss; ``sent``: the column a
    re-send stamps; ``named``: SQL for what precedes a blocker's reason (Airflow names the
    trigger there). Shared by both stores' REAP_DEAD (Airflow mode's bookkeeping has the same
    columns)."""
    return f"""
        owner_id = CASE WHEN f.take THEN $5::bigint END,
        attempt = {row}.attempt + f.take::int,
        claimed_at = CASE WHEN f.take THEN now() ELSE {row}.claimed_at END,
        {sent} = now(),
        failures = {row}.failures + (f.blame AND NOT f.block)::int,
        blocked_attempts = CASE
            WHEN f.block AND NOT ({row}.attempt = ANY({row}.blocked_attempts))
            THEN {row}.blocked_attempts || {row}.attempt ELSE {row}.blocked_attempts END,
        quarantined_at = CASE WHEN f.quarantine THEN now() END,
        last_error = CASE
            WHEN f.block THEN format(
                '%sit blocked the event loop of consumer %s past its lease (%s runs blocked)',
                {named}, f.owner_id, cardinality({row}.blocked_attempts)
                    + (NOT ({row}.attempt = ANY({row}.blocked_attempts)))::int)
            WHEN f.blame
            THEN format('consumer %s died while running it (%s ungraceful losses)',
                        f.owner_id, {row}.failures + 1)
            ELSE {row}.last_error END"""


# Blame and quarantine of one dead owner's trigger, the columns of CTE ``blamed`` (both
# stores): ``d`` the dead consumer, ``row`` the trigger's bookkeeping, ``id`` its id column.
# A consumer that held a known loop-blocker was stalled by it, most likely past its lease
# (its own strike lands only once the block ends): only the blocker is blamed, and the
# innocents it stalled are freed or taken uncharged. Otherwise probation decides.
def blame_columns(row: str, id_: str) -> str:
    return f"""
           d.witnessed AND CASE
               WHEN d.stalled THEN cardinality({row}.blocked_attempts) > 0
               WHEN cardinality(d.probation) = 0 THEN true
               ELSE {id_} = ANY(d.probation) END AS blame,
           d.stalled AND cardinality({row}.blocked_attempts) > 0 AS blocker,
           cardinality({row}.blocked_attempts)
               + (NOT ({row}.attempt = ANY({row}.blocked_attempts)))::int AS blocks,
           d.probation = ARRAY[{id_}::bigint] AS alone"""


# Whether the dead consumer ``d`` held a known loop-blocker (a partial index holds just them).
def stalled(table: str, owner: str = "owner_id") -> str:
    return f"""EXISTS (
               SELECT 1 FROM {table} b
               WHERE b.{owner} = d.id AND cardinality(b.blocked_attempts) > 0) AS stalled"""


# Consumers whose lease expired: free their triggers for re-sending. An ungraceful loss
# counts against the triggers to blame (a known loop-blocker it held, else those on
# probation if any, else all); a trigger blamed alone, or too often, is quarantined and its
# task failed naming the class ($7: the blocked runs that quarantine a blocker).
# A reaping consumer ($5, with room for $6) takes the triggers it may run over in the same
# rewrite: of its queues ($1), not suspects after this loss, not refused by it. Freeing and
# then claiming rewrote every row twice, which made the failover of a million twice as long.
# At most $4 triggers a statement: a consumer that held a million is taken over in batches,
# each started (or re-sent) while the next is rewritten. The dead row stays (locked by each
# batch, so two reapers never free the same triggers) until a batch frees its last trigger.
REAP_DEAD = f"""
WITH dead AS (
    -- witnessed: another process kept one row valid across this one's expiry with a lease
    -- no longer than this one's, so it wrote to the database during the very lease period
    -- this one failed to renew in. If none did, the database was away for everyone (an
    -- outage fences every consumer at once): no trigger is to blame for that.
    SELECT d.id, d.probation, EXISTS (
               SELECT 1 FROM consumer w
               WHERE w.id <> d.id AND w.expires_at > now() AND w.started_at < d.expires_at
                 AND w.expires_at - w.renewed_at <= d.expires_at - d.renewed_at
           ) AS witnessed,
           {stalled("trigger")}
    FROM consumer d
    WHERE d.expires_at < now() AND (d.queues && $1::text[] OR $2)
    FOR UPDATE OF d SKIP LOCKED
), blamed AS (
    -- each dead owner's triggers by trigger_owner (a lateral lookup: a join let the planner
    -- hash all of trigger, a million rows each batch)
    SELECT t.id, t.owner_id, t.queue, t.failures, t.rejected_by, {blame_columns("t", "t.id")}
    FROM dead d CROSS JOIN LATERAL (
        SELECT t.id, t.owner_id, t.queue, t.failures, t.rejected_by, t.attempt,
               t.blocked_attempts
        FROM trigger t WHERE t.owner_id = d.id LIMIT $4) t
    LIMIT $4
), judged AS (
    SELECT b.id, b.owner_id, b.blame, b.blame AND b.blocker AS block,
           b.blame AND CASE WHEN b.blocker THEN b.blocks >= $7
                            ELSE b.alone OR b.failures + 1 >= $3 END AS quarantine,
           $5::bigint IS NOT NULL AND b.queue = ANY($1::text[])
               AND b.failures + (b.blame AND NOT b.blocker)::int < {SUSPECT_FAILURES}
               AND NOT coalesce($5::bigint = ANY(b.rejected_by), false) AS takeable
    FROM blamed b
), fate AS (
    SELECT j.*, j.takeable AND NOT j.quarantine
               AND row_number() OVER (PARTITION BY j.takeable ORDER BY j.id) <= $6 AS take
    FROM judged j
), freed AS (
    UPDATE trigger t SET {take_or_free("t", "dispatched_at")}
    -- by trigger_pkey: "= ANY" of the batch's ids, not a hash of the whole table; and only
    -- while the dead consumer still owns it (a claim may have taken it meanwhile)
    FROM fate f WHERE t.id = f.id AND t.owner_id = f.owner_id
      AND t.id = ANY(ARRAY(SELECT id FROM blamed))
    RETURNING t.*, f.take, f.block
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_QUARANTINED}',
            'message', CASE WHEN f.block
                THEN format('trigger %s (%s) was quarantined after it blocked the event loop '
                            '(%s runs blocked)', f.id, f.classpath,
                            cardinality(f.blocked_attempts))
                ELSE format('trigger %s (%s) was quarantined after its consumers died %s '
                            'time(s) while running it', f.id, f.classpath, f.failures) END,
            'deferred_next_method', ti.next_method, 'deferred_next_kwargs', ti.next_kwargs),
        trigger_timeout = NULL, updated_at = clock_timestamp()
    FROM freed f WHERE f.quarantined_at IS NOT NULL AND ti.trigger_id = f.id
      AND ti.state = 'deferred'
      AND ti.trigger_id = ANY(ARRAY(SELECT id FROM freed WHERE quarantined_at IS NOT NULL))
), gone AS (
    -- a batch short of the limit freed everything the dead held
    DELETE FROM consumer WHERE id IN (SELECT id FROM dead)
      AND (SELECT count(*) FROM blamed) < $4
    RETURNING id
)
-- the columns of a claim for what this consumer took (kwargs only for those)
SELECT c.id, c.attempt, c.classpath, CASE WHEN c.take THEN c.kwargs END AS kwargs, c.queue,
       c.failures, c.traceparent, extract(epoch FROM c.timeout_at)::float8 AS timeout_at,
       format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) AS task,
       c.take AS taken, c.quarantined_at IS NOT NULL AS quarantined,
       (SELECT count(*) FROM gone) AS dead
FROM freed c LEFT JOIN task_instance ti ON c.take AND ti.trigger_id = c.id
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

QUEUE_CONSUMERS = """
SELECT q, count(c.id) AS consumers
FROM unnest($1::text[]) AS q
LEFT JOIN consumer c ON c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
                     AND q = ANY(c.queues)
GROUP BY q
"""
