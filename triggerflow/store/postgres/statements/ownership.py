"""The ownership statements, written once for both SQL stores.

Both modes keep the same bookkeeping of who runs each trigger row (``owner_id``, ``attempt``,
``claimed_at``, ``failures``, ``rejected_by``, ``blocked_attempts``, ``quarantined_at``,
``last_error``, the time of the last send) and the same ``consumer`` lease table; only where
they keep it differs. Native mode keeps it in its ``trigger`` rows; Airflow mode in
``triggerflow.trigger_state`` beside Airflow's ``trigger`` rows, which may have no queue (the
default queue, a parameter, serves those) and may belong to an Airflow team. A
``Bookkeeping`` says where (``bookkeeping.NATIVE``, ``airflow.statements.bookkeeping``); its
``render`` writes each ``Template`` here out for it.

In a template, ``s`` is a row's bookkeeping, ``{t}`` the alias that reads the trigger row's
own columns (``classpath``, ``id``: the same row in native mode), and each field below says
how the two modes differ (``bookkeeping``). ``tools/mutate_sql.py`` mutates the templates, so that a condition
dropped here must fail a contract case of both stores.
"""

from __future__ import annotations

from triggerflow.store.interface import SUSPECT_FAILURES
from triggerflow.store.postgres.statements.bookkeeping import Template

# The claimer's own live lease row, key-share locked. A claim takes nothing once the claimer's
# lease is over in the database (a peer ended it, a reaper deleted the row): the rows would
# name an owner no reaper frees. The lock makes a reaper's delete of the row wait for the
# claim (its FOR UPDATE SKIP LOCKED passes the row by, to reap it and what it claimed next
# time); renewals do not conflict with it.
MY_LEASE = "me AS (SELECT id FROM {consumer} WHERE id = $1 AND expires_at > now() FOR KEY SHARE)"

# Bisection of suspects: take half of the unclaimed triggers at the highest suspicion level
# (at least one), claim them together and record them on my row: if I die now, only they are
# blamed and climb a level; if they survive probation they are cleared. A killer among N
# triggers is alone after about log2(N) deaths, and N innocents clear in two probations.
CLAIM_PROBATION = Template(f"""
WITH {MY_LEASE}, worst AS (
    SELECT s.failures AS f, count(*) AS n FROM {{state}} s{{joined}}
    WHERE {{queue}} = ANY($2::text[]) AND s.owner_id IS NULL AND s.quarantined_at IS NULL
      AND s.failures >= {SUSPECT_FAILURES} AND {{in_team}}
    GROUP BY s.failures ORDER BY s.failures DESC LIMIT 1
), candidate AS (
    SELECT s.{{key}} AS id FROM worst, {{state}} s{{joined}}
    WHERE {{queue}} = ANY($2::text[]) AND s.owner_id IS NULL AND s.quarantined_at IS NULL
      AND s.failures = worst.f AND NOT ($1 = ANY(s.rejected_by)) AND {{in_team}}
      AND EXISTS (SELECT 1 FROM me)
    ORDER BY s.{{key}}
    LIMIT (SELECT least(greatest(1, (n + 1) / 2), $3::int) FROM worst)
    FOR UPDATE OF s SKIP LOCKED
), claimed AS (
    UPDATE {{state}} s SET owner_id = $1, attempt = s.attempt + 1, claimed_at = now()
    FROM candidate WHERE s.{{key}} = candidate.id
    RETURNING s.*
), on_probation AS (
    UPDATE {{consumer}}
    SET probation = (SELECT coalesce(array_agg({{key}}), '{{{{}}}}') FROM claimed)
    WHERE id = $1
)
SELECT {{claimed}}
""", default=4, team=5)

CLEAR_PROBATION = Template("""
WITH cleared AS (
    UPDATE {state} SET failures = 0 WHERE {key} = ANY($2::{ids}) AND owner_id = $1 RETURNING {key}
)
UPDATE {consumer} SET probation = '{{}}' WHERE id = $1
""")

# Hand triggers back (graceful: no failure counted) so any consumer of the queue can take
# them; with $3 the caller also records that it could not load them (mixed code versions).
RELEASE = Template("""
UPDATE {state} s SET owner_id = NULL, {sent} = now(),
       rejected_by = CASE WHEN $3 THEN s.rejected_by || $1::bigint ELSE s.rejected_by END,
       last_error = coalesce($4, s.last_error)
{from_trigger}
WHERE {is_trigger}s.owner_id = $1 AND ($2::{ids} IS NULL OR s.{key} = ANY($2::{ids}))
RETURNING s.{key} AS id, {queue} AS queue
""", default=5)

# Reconcile: rows I fired (or failed to start) but still own at that attempt lost their
# event on the way; free them for re-sending. Found by key, never by scanning all I hold.
RELEASE_LOST = Template("""
UPDATE {state} s SET owner_id = NULL, {sent} = now()
FROM unnest($2::{ids}, $3::int[]) AS lost(id, attempt){trigger_from}
WHERE {is_trigger}s.{key} = lost.id AND s.attempt = lost.attempt AND s.owner_id = $1
RETURNING s.{key} AS id, {queue} AS queue
""", default=4)

# What a claim or take-over whose reply never came may have made mine: my rows claimed
# lately (by their owner index; read only after such a failure, never on the hot path).
TAKEN_SINCE = Template("""
SELECT {key} AS id, attempt FROM {state}
WHERE owner_id = $1 AND claimed_at >= now() - make_interval(secs => $2)
""")

# Triggers I refused (could not load) that no other live consumer of their queue (and, in
# Airflow mode, of their team) may load: fail their tasks naming the class, instead of
# passing them round forever.
FAIL_UNLOADABLE = Template("""
WITH gone AS (
    DELETE FROM {state} s {using_trigger}
    WHERE {is_trigger}s.{key} = ANY($1::{ids}) AND s.owner_id IS NULL
      AND $2::bigint = ANY(s.rejected_by)
      AND NOT EXISTS (
          SELECT 1 FROM {consumer} c
          WHERE c.kind = 'consumer' AND c.expires_at > now() AND {queue} = ANY(c.queues)
            AND NOT (c.id = ANY(s.rejected_by)) AND {serves})
    RETURNING s.{key} AS id, s.last_error,
        format('trigger %s (%s): no live consumer of queue %s can load it (%s)',
               s.{key}, {t}.classpath, {queue}, coalesce(s.last_error, 'unknown')) AS why
), failed AS (
    {fail_unloadable}
    FROM gone f WHERE ti.trigger_id = f.id AND ti.state = 'deferred'
)
SELECT id FROM gone
""", default=3)

# Live consumers of a queue that have not yet refused a trigger: can anyone else load it?
OTHER_LOADERS = Template("""
SELECT count(*) FROM {consumer} c, {rows}
WHERE {t}.id = $1 AND c.kind = 'consumer' AND c.expires_at > now() AND {queue} = ANY(c.queues)
  AND NOT (c.id = ANY(coalesce(s.rejected_by, '{{}}'))) AND c.id <> $2 AND {serves}
""", default=3)

# Cancelled on their owner: the owner stopped them and drops their bookkeeping (native mode:
# the rows themselves).
FORGET_HELD = Template("DELETE FROM {state} WHERE {key} = ANY($1::{ids}) AND owner_id = $2")

# A strike: the trigger blocked my ($1) event loop for $4 seconds in its run $3, counted as
# one blocked run whoever holds it now: while my loop was blocked my lease ran out and a
# peer may have taken it over at a raised attempt (and been blocked in turn), so a strike
# fenced by attempt would be refused in any fleet. Fenced instead by my queues ($6): a
# team's consumer charges only its own team's triggers. Each run counts once (a retry, or a
# reaper that already counted it, changes nothing). At $5 blocked runs it is quarantined as
# REAP_DEAD quarantines (the reason names the class and the block); a row still at $3 held
# by me or by nobody (my lease may have expired, a reaper may have freed it) is freed to be
# re-sent at a raised attempt, so an event of the struck run no longer applies.
STRIKE = Template("""
WITH target AS (
    SELECT s.{key} AS id, cardinality(s.blocked_attempts) + 1 >= $5 AS quarantine,
           cardinality(s.blocked_attempts) + 1 >= $5
               OR (s.attempt = $3 AND (s.owner_id = $1 OR s.owner_id IS NULL)) AS release
    FROM {state} s{joined}
    WHERE s.{key} = $2 AND {queue} = ANY($6::text[]) AND s.quarantined_at IS NULL
      AND $3 <= s.attempt AND NOT ($3 = ANY(s.blocked_attempts))
    FOR UPDATE OF s
), struck AS (
    UPDATE {state} s SET
        blocked_attempts = s.blocked_attempts || $3::int,
        owner_id = CASE WHEN g.release THEN NULL ELSE s.owner_id END,
        attempt = s.attempt + g.release::int,
        {sent} = CASE WHEN g.release THEN now() ELSE s.{sent} END,
        quarantined_at = CASE WHEN g.quarantine THEN now() END,
        last_error = format('%sit blocked the event loop for %s s on consumer %s (%s runs blocked)',
                            {named}, round($4::numeric, 1), $1, cardinality(s.blocked_attempts) + 1)
    FROM target g{trigger_from}
    WHERE {is_trigger}s.{key} = g.id
    RETURNING s.{key} AS id, {queue} AS queue, {t}.classpath,
              cardinality(s.blocked_attempts) AS blocks, s.quarantined_at IS NOT NULL AS quarantined,
              s.last_error, g.release,
              format('trigger %s (%s) was quarantined after it blocked the event loop for %s s '
                     '(%s runs blocked)', s.{key}, {t}.classpath, round($4::numeric, 1),
                     cardinality(s.blocked_attempts)) AS why
), failed AS (
    {fail_quarantined}
    FROM struck f WHERE f.quarantined AND ti.trigger_id = f.id AND ti.state = 'deferred'
)
SELECT id, queue, classpath, blocks, quarantined, release AND NOT quarantined AS freed
FROM struck
""", default=7)

# Live consumers subscribed to each queue (the writer's reaper: a queue with waiting rows and
# none is unserved).
QUEUE_CONSUMERS = Template("""
SELECT q, count(c.id) AS consumers
FROM unnest($1::text[]) AS q
LEFT JOIN {consumer} c ON c.kind = 'consumer' AND c.expires_at > now() AND c.subscribed
    AND q = ANY(c.queues)
GROUP BY q
""")

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
REAP_DEAD = Template(f"""
WITH dead AS (
    -- witnessed: another process kept one row valid across this one's expiry with a lease
    -- no longer than this one's, so it wrote to the database during the very lease period
    -- this one failed to renew in. If none did, the database was away for everyone (an
    -- outage fences every consumer at once): no trigger is to blame for that.
    SELECT d.id, d.probation, EXISTS (
               SELECT 1 FROM {{consumer}} w
               WHERE w.id <> d.id AND w.expires_at > now() AND w.{{registered}} < d.expires_at
                 AND w.expires_at - w.renewed_at <= d.expires_at - d.renewed_at
           ) AS witnessed,
           -- it held a known loop-blocker (a partial index holds just them)
           EXISTS (SELECT 1 FROM {{state}} b
                   WHERE b.owner_id = d.id AND cardinality(b.blocked_attempts) > 0) AS stalled
    FROM {{consumer}} d
    WHERE d.expires_at < now() AND (d.queues && $1::text[] OR $2) AND {{reaps}}
    FOR UPDATE OF d SKIP LOCKED
), blamed AS (
    -- A consumer that held a known loop-blocker was stalled by it, most likely past its
    -- lease (its own strike lands only once the block ends): only the blocker is blamed,
    -- and the innocents it stalled are freed or taken uncharged. Otherwise probation decides.
    SELECT s.*,
           d.witnessed AND CASE
               WHEN d.stalled THEN cardinality(s.blocked_attempts) > 0
               WHEN cardinality(d.probation) = 0 THEN true
               ELSE s.id = ANY(d.probation) END AS blame,
           d.stalled AND cardinality(s.blocked_attempts) > 0 AS blocker,
           cardinality(s.blocked_attempts)
               + (NOT (s.attempt = ANY(s.blocked_attempts)))::int AS blocks,
           d.probation = ARRAY[s.id::bigint] AS alone
    -- each dead owner's triggers by their owner index (a lateral lookup: a join let the
    -- planner hash all of trigger, a million rows each batch)
    FROM dead d CROSS JOIN LATERAL (
        SELECT s.{{key}} AS id, s.owner_id, s.failures, s.rejected_by, s.attempt,
               s.blocked_attempts, {{queue}} AS queue, {{t}}.classpath, {{runnable}} AS runnable
        FROM {{state}} s{{joined}} WHERE s.owner_id = d.id LIMIT $4) s
    LIMIT $4
), judged AS (
    SELECT b.id, b.owner_id, b.classpath, b.blame, b.blame AND b.blocker AS block,
           b.blame AND CASE WHEN b.blocker THEN b.blocks >= $7
                            ELSE b.alone OR b.failures + 1 >= $3 END AS quarantine,
           coalesce($5::bigint IS NOT NULL AND b.queue = ANY($1::text[])
               AND b.failures + (b.blame AND NOT b.blocker)::int < {SUSPECT_FAILURES}
               AND NOT coalesce($5::bigint = ANY(b.rejected_by), false) AND b.runnable,
               false) AS takeable  -- never NULL: it sets the attempt
    FROM blamed b
), fate AS (
    SELECT j.*, j.takeable AND NOT j.quarantine
               AND row_number() OVER (PARTITION BY j.takeable ORDER BY j.id) <= $6 AS take
    FROM judged j
), freed AS (
    -- taken by the reaping consumer $5 at a raised attempt, or freed; blamed and quarantined
    -- as judged, a blamed known loop-blocker by counting the run it blocked, not a loss
    UPDATE {{state}} s SET
        owner_id = CASE WHEN f.take THEN $5::bigint END,
        attempt = s.attempt + f.take::int,
        claimed_at = CASE WHEN f.take THEN now() ELSE s.claimed_at END,
        {{sent}} = now(),
        failures = s.failures + (f.blame AND NOT f.block)::int,
        blocked_attempts = CASE
            WHEN f.block AND NOT (s.attempt = ANY(s.blocked_attempts))
            THEN s.blocked_attempts || s.attempt ELSE s.blocked_attempts END,
        quarantined_at = CASE WHEN f.quarantine THEN now() END,
        last_error = CASE
            WHEN f.block THEN format(
                '%sit blocked the event loop of consumer %s past its lease (%s runs blocked)',
                {{named}}, f.owner_id, cardinality(s.blocked_attempts)
                    + (NOT (s.attempt = ANY(s.blocked_attempts)))::int)
            WHEN f.blame
            THEN format('consumer %s died while running it (%s ungraceful losses)',
                        f.owner_id, s.failures + 1)
            ELSE s.last_error END
    -- by the key: "= ANY" of the batch's ids, not a hash of the whole table; and only while
    -- the dead consumer still owns it (a claim that committed while this waited on the row
    -- is re-checked here, READ COMMITTED, and stands)
    FROM fate f{{trigger_from}}
    WHERE {{is_trigger}}s.{{key}} = f.id AND s.owner_id = f.owner_id
      AND s.{{key}} = ANY(ARRAY(SELECT id FROM blamed))
    RETURNING s.*, f.take, s.quarantined_at IS NOT NULL AS quarantined,
        CASE WHEN f.block
            THEN format('trigger %s (%s) was quarantined after it blocked the event loop '
                        '(%s runs blocked)', f.id, f.classpath, cardinality(s.blocked_attempts))
            ELSE format('trigger %s (%s) was quarantined after its consumers died %s '
                        'time(s) while running it', f.id, f.classpath, s.failures) END AS why
), failed AS (
    {{fail_quarantined}}
    FROM freed f WHERE f.quarantined AND ti.trigger_id = f.{{key}} AND ti.state = 'deferred'
      AND ti.trigger_id = ANY(ARRAY(SELECT {{key}} FROM freed WHERE quarantined))
), gone AS (
    -- a batch short of the limit freed everything the dead held
    DELETE FROM {{consumer}} WHERE id IN (SELECT id FROM dead)
      AND (SELECT count(*) FROM blamed) < $4
    RETURNING id
)
SELECT {{reaped}}
""", default=8, team=9)

# Run before the writer's apply in one transaction when a team holds locks on its own rows:
# locks the bookkeeping and task rows no other transaction holds (SKIP LOCKED: never waits)
# and returns the events ($1 ids, $2 attempts, $3 queues) whose rows are held elsewhere; the
# writer retries those later. Events that match no row (stale, duplicate) are not held: the
# apply ignores them. Each event's rows by their own index lookups (OFFSET 0 keeps the
# subquery one), whatever the statistics of tables a burst's clean-up just emptied.
HELD_ELSEWHERE = Template("""
WITH ev AS (
    SELECT * FROM unnest($1::{ids}, $2::int[], $3::text[]) AS e(trigger_id, attempt, queue)
), matching AS MATERIALIZED (
    SELECT m.id FROM ev CROSS JOIN LATERAL (
        SELECT s.{key} AS id FROM {state} s{joined}
        WHERE s.{key} = ev.trigger_id AND s.attempt = ev.attempt AND {queue} = ev.queue
        OFFSET 0
    ) AS m
), got_row AS MATERIALIZED (
    SELECT g.id FROM matching CROSS JOIN LATERAL (
        SELECT s.{key} AS id FROM {state} s WHERE s.{key} = matching.id
        FOR UPDATE SKIP LOCKED
    ) AS g
), got_task AS MATERIALIZED (
    SELECT ti.trigger_id FROM task_instance ti WHERE ti.trigger_id IN (SELECT id FROM got_row)
    FOR UPDATE SKIP LOCKED
)
SELECT m.id FROM matching m
WHERE m.id NOT IN (SELECT id FROM got_row)
   OR EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = m.id
              AND ti.trigger_id NOT IN (SELECT trigger_id FROM got_task))
""", default=4)

# A consumer's, in the order each store's ``claims`` module names their renderings.
CLAIMS = (CLAIM_PROBATION, CLEAR_PROBATION, RELEASE, RELEASE_LOST, TAKEN_SINCE, FAIL_UNLOADABLE,
          OTHER_LOADERS, FORGET_HELD, STRIKE)

# Every template above, by the name both stores' statement modules give its rendering.
TEMPLATES: dict[str, Template] = {
    "CLAIM_PROBATION": CLAIM_PROBATION, "CLEAR_PROBATION": CLEAR_PROBATION, "RELEASE": RELEASE,
    "RELEASE_LOST": RELEASE_LOST, "TAKEN_SINCE": TAKEN_SINCE, "FAIL_UNLOADABLE": FAIL_UNLOADABLE,
    "OTHER_LOADERS": OTHER_LOADERS, "FORGET_HELD": FORGET_HELD, "STRIKE": STRIKE,
    "QUEUE_CONSUMERS": QUEUE_CONSUMERS, "REAP_DEAD": REAP_DEAD,
    "HELD_ELSEWHERE": HELD_ELSEWHERE,
}
