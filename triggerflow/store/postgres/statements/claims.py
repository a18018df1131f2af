"""A consumer's statements (:class:`~triggerflow.store.ClaimStore`,
:class:`~triggerflow.store.ProbationStore`): claim, hand back, probation, strikes."""

from triggerflow.store.interface import SUSPECT_FAILURES
from triggerflow.store.postgres.statements import ownership
from triggerflow.store.postgres.statements.bookkeeping import NATIVE

MY_LEASE = ownership.MY_LEASE.format(consumer="consumer")

# Claim delivered ids in one statement: only of my queues, only where no live owner holds
# them. Suspects (lost ungracefully twice or more) are not claimed here: they run on
# probation (CLAIM_PROBATION) and come back flagged so the consumer knows to look for them;
# triggers this consumer could not load come back flagged 'refused', to pass on.
# One loss is not suspicious enough to slow a failover down.
CLAIM = f"""
WITH {MY_LEASE}, candidate AS (
    -- every delivered id is read once, by trigger_pkey; triggers I refused before come back
    -- flagged from the same scan (a separate "refused" lookup matched the partial index of
    -- all unclaimed triggers and read the whole backlog once per claim)
    SELECT t.id, t.failures, t.queue, ($1 = ANY(t.rejected_by)) AS refused,
           t.owner_id IS NULL AS unowned
    FROM trigger t
    WHERE t.id = ANY($2::bigint[]) AND t.queue = ANY($3::text[])
      AND t.quarantined_at IS NULL AND EXISTS (SELECT 1 FROM me)
      AND (t.owner_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM consumer o WHERE o.id = t.owner_id AND o.expires_at > now()))
    ORDER BY t.id
    FOR UPDATE OF t SKIP LOCKED
), claimed AS (
    UPDATE trigger t SET owner_id = $1, attempt = t.attempt + 1, claimed_at = now()
    FROM candidate
    WHERE t.id = candidate.id AND candidate.failures < {SUSPECT_FAILURES} AND NOT candidate.refused
    RETURNING t.*
)
SELECT {NATIVE.claimed}
UNION ALL
SELECT id, 0, '', '', '', failures, NULL, NULL, NULL, 'suspect' FROM candidate
WHERE failures >= {SUSPECT_FAILURES} AND NOT refused
UNION ALL
SELECT id, 0, '', '', queue, failures, NULL, NULL, NULL, 'refused' FROM candidate
WHERE refused AND unowned
"""

# Backstop for cancellation: triggers I hold whose task is no longer deferred on them.
SWEEP_CANCELLED = """
WITH entry AS (
    -- only what changed: the log a row trigger on task_instance keeps (migration 0002),
    -- never everything I hold. Each entry looks its trigger up by primary key (subqueries,
    -- which the planner cannot turn into a merge join over all of trigger_pkey); mine, and
    -- those whose trigger is gone (deleted by CANCEL, the writer, a reaper), are taken.
    SELECT l.ctid AS at, l.trigger_id, o.owner FROM trigger_cancel_log l
    CROSS JOIN LATERAL (
        SELECT (SELECT t.owner_id FROM trigger t WHERE t.id = l.trigger_id) AS owner,
               EXISTS (SELECT 1 FROM trigger t WHERE t.id = l.trigger_id) AS live) o
    WHERE o.owner = $1 OR NOT o.live
    FOR UPDATE OF l SKIP LOCKED
), gone AS (
    DELETE FROM trigger t USING entry e
    WHERE e.owner = $1 AND t.id = e.trigger_id AND t.owner_id = $1 AND NOT EXISTS (
        SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id AND ti.state = 'deferred')
    RETURNING t.id
), done AS (
    DELETE FROM trigger_cancel_log l WHERE l.ctid IN (SELECT at FROM entry)
)
SELECT DISTINCT id FROM gone
"""

# The statements every store runs alike, over native mode's bookkeeping (ownership.py).
(CLAIM_PROBATION, CLEAR_PROBATION, RELEASE, RELEASE_LOST, TAKEN_SINCE, FAIL_UNLOADABLE,
 OTHER_LOADERS, FORGET_HELD, STRIKE) = NATIVE.render_all(ownership.CLAIMS)
