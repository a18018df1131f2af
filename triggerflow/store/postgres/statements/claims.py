"""A consumer's statements (:class:`~triggerflow.store.ClaimStore`,
:class:`~triggerflow.store.ProbationStore`): claim, hand back, probation, strikes."""

from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store.interface import SUSPECT_FAILURES

_CLAIM_COLUMNS = """
    c.id, c.attempt, c.classpath, c.kwargs, c.queue, c.failures, c.traceparent,
    extract(epoch FROM c.timeout_at)::float8 AS timeout_at,
    CASE WHEN ti.task_id IS NOT NULL  -- NULL once the task left (a cancel the owner has yet to sweep)
        THEN format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) END AS task
"""

# A claim takes nothing once the claimer's own lease is over in the database (a peer ended it,
# a reaper deleted the row): the rows would name an owner no reaper frees. The key-share lock
# makes a reaper's delete of the row wait for the claim (its FOR UPDATE SKIP LOCKED passes the
# row by, to reap it and what it claimed next time); renewals do not conflict with it.
MY_LEASE = "me AS (SELECT id FROM consumer WHERE id = $1 AND expires_at > now() FOR KEY SHARE)"

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
SELECT {_CLAIM_COLUMNS}, 'claimed' AS outcome
FROM claimed c LEFT JOIN task_instance ti ON ti.trigger_id = c.id
UNION ALL
SELECT id, 0, '', '', '', failures, NULL, NULL, NULL, 'suspect' FROM candidate
WHERE failures >= {SUSPECT_FAILURES} AND NOT refused
UNION ALL
SELECT id, 0, '', '', queue, failures, NULL, NULL, NULL, 'refused' FROM candidate
WHERE refused AND unowned
"""

# Bisection of suspects: take half of the unclaimed triggers at the highest suspicion level
# (at least one), claim them together and record them on my row: if I die now, only they are
# blamed and climb a level; if they survive probation they are cleared. A killer among N
# triggers is alone after about log2(N) deaths, and N innocents clear in two probations.
CLAIM_PROBATION = f"""
WITH {MY_LEASE}, worst AS (
    SELECT failures AS f, count(*) AS n FROM trigger
    WHERE queue = ANY($2::text[]) AND owner_id IS NULL AND quarantined_at IS NULL
      AND failures >= {SUSPECT_FAILURES}
    GROUP BY failures ORDER BY failures DESC LIMIT 1
), candidate AS (
    SELECT t.id FROM trigger t, worst
    WHERE t.queue = ANY($2::text[]) AND t.owner_id IS NULL AND t.quarantined_at IS NULL
      AND t.failures = worst.f AND NOT ($1 = ANY(t.rejected_by)) AND EXISTS (SELECT 1 FROM me)
    ORDER BY t.id
    LIMIT (SELECT least(greatest(1, (n + 1) / 2), $3::int) FROM worst)
    FOR UPDATE OF t SKIP LOCKED
), claimed AS (
    UPDATE trigger t SET owner_id = $1, attempt = t.attempt + 1, claimed_at = now()
    FROM candidate WHERE t.id = candidate.id
    RETURNING t.*
), on_probation AS (
    UPDATE consumer SET probation = (SELECT coalesce(array_agg(id), '{{}}') FROM claimed)
    WHERE id = $1
)
SELECT {_CLAIM_COLUMNS}, 'claimed' AS outcome
FROM claimed c LEFT JOIN task_instance ti ON ti.trigger_id = c.id
"""

CLEAR_PROBATION = """
WITH cleared AS (
    UPDATE trigger SET failures = 0 WHERE id = ANY($2::bigint[]) AND owner_id = $1 RETURNING id
)
UPDATE consumer SET probation = '{}' WHERE id = $1
"""

# Hand triggers back (graceful: no failure counted) so any consumer of the queue can take
# them; with $3 the caller also records that it could not load them (mixed code versions).
RELEASE = """
UPDATE trigger SET owner_id = NULL, dispatched_at = now(),
       rejected_by = CASE WHEN $3 THEN rejected_by || $1::bigint ELSE rejected_by END,
       last_error = coalesce($4, last_error)
WHERE owner_id = $1 AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]))
RETURNING id, queue
"""

# Reconcile: rows I fired (or failed to start) but still own at that attempt lost their
# event on the way; free them for re-sending. Found by primary key, never by scanning all I hold.
RELEASE_LOST = """
UPDATE trigger t SET owner_id = NULL, dispatched_at = now()
FROM unnest($2::bigint[], $3::int[]) AS lost(id, attempt)
WHERE t.id = lost.id AND t.attempt = lost.attempt AND t.owner_id = $1
RETURNING t.id, t.queue
"""

# What a claim or take-over whose reply never came may have made mine: my rows claimed
# lately (by trigger_owner; read only after such a failure, never on the hot path).
TAKEN_SINCE = """
SELECT id, attempt FROM trigger
WHERE owner_id = $1 AND claimed_at >= now() - make_interval(secs => $2)
"""

# Triggers I refused (could not load) that no other live consumer of their queue may still
# load: fail their tasks naming the class, instead of passing them round forever.
FAIL_UNLOADABLE = f"""
WITH gone AS (
    DELETE FROM trigger t
    WHERE t.id = ANY($1::bigint[]) AND t.owner_id IS NULL AND $2::bigint = ANY(t.rejected_by)
      AND NOT EXISTS (
          SELECT 1 FROM consumer c
          WHERE c.kind = 'consumer' AND c.expires_at > now() AND t.queue = ANY(c.queues)
            AND NOT (c.id = ANY(t.rejected_by)))
    RETURNING t.id, t.classpath, t.queue, t.last_error
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_UNLOADABLE}',
            'message', format('trigger %s (%s): no live consumer of queue %s can load it (%s)',
                              g.id, g.classpath, g.queue, coalesce(g.last_error, 'unknown'))),
        trigger_id = NULL, trigger_timeout = NULL, updated_at = clock_timestamp()
    FROM gone g WHERE ti.trigger_id = g.id AND ti.state = 'deferred'
)
SELECT id FROM gone
"""

# Live consumers of a queue that have not yet refused a trigger: can anyone else load it?
OTHER_LOADERS = """
SELECT count(*) FROM consumer c, trigger t
WHERE t.id = $1 AND c.kind = 'consumer' AND c.expires_at > now() AND t.queue = ANY(c.queues)
  AND NOT (c.id = ANY(t.rejected_by)) AND c.id <> $2
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

# Cancelled on their owner: the owner stopped them and drops its rows.
FORGET_HELD = "DELETE FROM trigger WHERE id = ANY($1::bigint[]) AND owner_id = $2"

# A strike: the trigger blocked my ($1) event loop for $4 seconds in its run $3, counted as
# one blocked run whoever holds it now: while my loop was blocked my lease ran out and a
# peer may have taken it over at a raised attempt (and been blocked in turn), so a strike
# fenced by attempt would be refused in any fleet. Fenced instead by my queues ($6): a
# team's consumer charges only its own team's triggers. Each run counts once (a retry, or a
# reaper that already counted it, changes nothing). At $5 blocked runs it is quarantined as
# REAP_DEAD quarantines (the message names the class and the block); a row still at $3 held
# by me or by nobody (my lease may have expired, a reaper may have freed it) is freed to be
# re-sent at a raised attempt, so an event of the struck run no longer applies.
STRIKE = f"""
WITH target AS (
    SELECT t.id, cardinality(t.blocked_attempts) + 1 >= $5 AS quarantine,
           cardinality(t.blocked_attempts) + 1 >= $5
               OR (t.attempt = $3 AND (t.owner_id = $1 OR t.owner_id IS NULL)) AS release
    FROM trigger t
    WHERE t.id = $2 AND t.queue = ANY($6::text[]) AND t.quarantined_at IS NULL
      AND $3 <= t.attempt AND NOT ($3 = ANY(t.blocked_attempts))
    FOR UPDATE
), struck AS (
    UPDATE trigger t SET
        blocked_attempts = t.blocked_attempts || $3::int,
        owner_id = CASE WHEN g.release THEN NULL ELSE t.owner_id END,
        attempt = t.attempt + g.release::int,
        dispatched_at = CASE WHEN g.release THEN now() ELSE t.dispatched_at END,
        quarantined_at = CASE WHEN g.quarantine THEN now() END,
        last_error = format('it blocked the event loop for %s s on consumer %s (%s runs blocked)',
                            round($4::numeric, 1), $1, cardinality(t.blocked_attempts) + 1)
    FROM target g WHERE t.id = g.id
    RETURNING t.id, t.queue, t.classpath, cardinality(t.blocked_attempts) AS blocks,
              t.quarantined_at, g.release
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_QUARANTINED}',
            'message', format('trigger %s (%s) was quarantined after it blocked the event loop '
                              'for %s s (%s runs blocked)', s.id, s.classpath,
                              round($4::numeric, 1), s.blocks),
            'deferred_next_method', ti.next_method, 'deferred_next_kwargs', ti.next_kwargs),
        trigger_timeout = NULL, updated_at = clock_timestamp()
    FROM struck s WHERE s.quarantined_at IS NOT NULL AND ti.trigger_id = s.id
      AND ti.state = 'deferred'
)
SELECT id, queue, classpath, blocks, quarantined_at IS NOT NULL AS quarantined,
       release AND quarantined_at IS NULL AS freed
FROM struck
"""
