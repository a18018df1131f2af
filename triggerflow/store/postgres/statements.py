"""The statements the hot paths run (SDK, consumer, writer, reaper), named after what they do.

Set-based (``unnest`` of arrays, one round trip per batch) and on database time only
(``now()``), so leases never depend on a process's clock. Admin and host-side statements
live in ``admin``; only ``store`` runs these.
"""

# -- SDK

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

# -- consumer

# Not counted as capacity until its first renewal says it is subscribed on the broker (the
# column defaults to true only for rows of processes older than it, during an upgrade).
REGISTER = """
INSERT INTO consumer (kind, host, pid, queues, capacity, version, expires_at,
                      subscribed)
VALUES ($1, $2, $3, $4::text[], $5, $6, now() + make_interval(secs => $7), false)
RETURNING id
"""

# One row per renewal, whatever the number of triggers held. Also reports, for the queues
# this process serves, whether a peer's lease has expired (so reaping starts at once) and how
# many triggers the live peers of the same queue set hold (for rebalancing after a rolling
# restart: consumers of different queue sets cannot take each other's triggers, so they must
# not count as peers, or they shed to each other forever).
# Whether a peer of my queues is dead is an EXISTS over the index of expiries (only expired
# rows are read). The peers' counts, for rebalancing only, are read when $5 asks for them
# (every few seconds): CASE leaves the subqueries unevaluated otherwise, so a renewal does
# not scan the consumer table (n processes x n rows each second).
# Only peers subscribed on the broker ($6 for my own row) count: one that cannot reach the
# broker (a wrong password) renews its lease but receives nothing, and counted it would
# make its peers shed triggers to it forever.
# $7 is my clock's offset from the database's as last measured (for ``status``); db_time is
# the database's clock now, against which the next offset is measured (skew.py).
RENEW = """
UPDATE consumer SET renewed_at = now(), expires_at = now() + make_interval(secs => $2),
       running = $3, subscribed = $6, clock_skew = $7
WHERE id = $1 AND expires_at > now()
RETURNING
    extract(epoch FROM clock_timestamp())::float8 AS db_time,
    EXISTS (SELECT 1 FROM consumer c
            WHERE c.expires_at <= now()
              AND (c.queues && $4::text[] OR cardinality($4::text[]) = 0))::int AS dead_peers,
    CASE WHEN $5 THEN (SELECT count(*) FROM consumer c
         WHERE c.kind = 'consumer' AND c.expires_at > now()
           AND CASE WHEN c.id = $1 THEN $6 ELSE c.subscribed END
           AND c.queues @> $4::text[] AND c.queues <@ $4::text[])
    ELSE 0 END AS live_peers,
    -- my own row as this renewal writes it: subqueries of RETURNING see it as it was
    -- (0 right after a claim of thousands made me shed them all to a peer with none)
    CASE WHEN $5 THEN (
         SELECT coalesce(sum(CASE WHEN c.id = $1 THEN $3 ELSE c.running END), 0)
         FROM consumer c
         WHERE c.kind = 'consumer' AND c.expires_at > now()
           AND CASE WHEN c.id = $1 THEN $6 ELSE c.subscribed END
           AND c.queues @> $4::text[] AND c.queues <@ $4::text[])
    ELSE 0 END AS peers_running
"""

# Leave: a straggler still owned (a claim that committed late) is freed and dated back so
# the next reaper sweep re-sends it at once, instead of waiting on an owner that is gone.
UNREGISTER = """
WITH stragglers AS (
    UPDATE trigger SET owner_id = NULL, dispatched_at = now() - interval '1 day'
    WHERE owner_id = $1 RETURNING id
)
DELETE FROM consumer WHERE id = $1
"""

# The broker presence queue of the consumer's current connection (named again after each
# reconnect and each new registration).
ANNOUNCE_PRESENCE = "UPDATE consumer SET presence = $2 WHERE id = $1 RETURNING id"

# The broker deleted a presence queue: its connection closed (a killed process). End that
# lease now, as its expiry would have, for the peers of its queues to reap at once. Only the
# incarnation that named it: a consumer that reconnected or re-registered named another.
# The lease's length is kept (renewed_at moves with expires_at), so REAP_DEAD's witness test
# judges the loss as it judges an expiry: a crash while running a trigger is blamed on it.
# Row security holds a team's consumer role to rows of its own queues.
PRESENCE_GONE = """
UPDATE consumer SET expires_at = now(), renewed_at = now() - (expires_at - renewed_at)
WHERE presence = $1 AND kind = 'consumer' AND expires_at > now() AND queues && $2::text[]
RETURNING id
"""

_CLAIM_COLUMNS = """
    c.id, c.attempt, c.classpath, c.kwargs, c.queue, c.failures, c.traceparent,
    extract(epoch FROM c.timeout_at)::float8 AS timeout_at,
    format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id) AS task
"""

# Claim delivered ids in one statement: only of my queues, only where no live owner holds
# them. Suspects (lost ungracefully twice or more) are not claimed here: they run on
# probation (CLAIM_PROBATION) and come back flagged so the consumer knows to look for them;
# triggers this consumer could not load come back flagged 'refused', to pass on.
# One loss is not suspicious enough to slow a failover down.
CLAIM = f"""
WITH candidate AS (
    -- every delivered id is read once, by trigger_pkey; triggers I refused before come back
    -- flagged from the same scan (a separate "refused" lookup matched the partial index of
    -- all unclaimed triggers and read the whole backlog once per claim)
    SELECT t.id, t.failures, t.queue, ($1 = ANY(t.rejected_by)) AS refused,
           t.owner_id IS NULL AS unowned
    FROM trigger t
    WHERE t.id = ANY($2::bigint[]) AND t.queue = ANY($3::text[])
      AND t.quarantined_at IS NULL
      AND (t.owner_id IS NULL OR NOT EXISTS (
            SELECT 1 FROM consumer o WHERE o.id = t.owner_id AND o.expires_at > now()))
    ORDER BY t.id
    FOR UPDATE OF t SKIP LOCKED
), claimed AS (
    UPDATE trigger t SET owner_id = $1, attempt = t.attempt + 1, claimed_at = now()
    FROM candidate WHERE t.id = candidate.id AND candidate.failures < 2 AND NOT candidate.refused
    RETURNING t.*
)
SELECT {_CLAIM_COLUMNS}, 'claimed' AS outcome
FROM claimed c LEFT JOIN task_instance ti ON ti.trigger_id = c.id
UNION ALL
SELECT id, 0, '', '', '', failures, NULL, NULL, NULL, 'suspect' FROM candidate
WHERE failures >= 2 AND NOT refused
UNION ALL
SELECT id, 0, '', '', queue, failures, NULL, NULL, NULL, 'refused' FROM candidate
WHERE refused AND unowned
"""

# Bisection of suspects: take half of the unclaimed triggers at the highest suspicion level
# (at least one), claim them together and record them on my row: if I die now, only they are
# blamed and climb a level; if they survive probation they are cleared. A killer among N
# triggers is alone after about log2(N) deaths, and N innocents clear in two probations.
CLAIM_PROBATION = f"""
WITH worst AS (
    SELECT failures AS f, count(*) AS n FROM trigger
    WHERE queue = ANY($2::text[]) AND owner_id IS NULL AND quarantined_at IS NULL
      AND failures >= 2
    GROUP BY failures ORDER BY failures DESC LIMIT 1
), candidate AS (
    SELECT t.id FROM trigger t, worst
    WHERE t.queue = ANY($2::text[]) AND t.owner_id IS NULL AND t.quarantined_at IS NULL
      AND t.failures = worst.f AND NOT ($1 = ANY(t.rejected_by))
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

# Triggers I refused (could not load) that no other live consumer of their queue may still
# load: fail their tasks naming the class, instead of passing them round forever.
FAIL_UNLOADABLE = """
WITH gone AS (
    DELETE FROM trigger t
    WHERE t.id = ANY($1::bigint[]) AND t.owner_id IS NULL AND $2::bigint = ANY(t.rejected_by)
      AND NOT EXISTS (
          SELECT 1 FROM consumer c
          WHERE c.kind = 'consumer' AND c.expires_at > now() AND t.queue = ANY(c.queues)
            AND NOT (c.id = ANY(t.rejected_by)))
    RETURNING t.id, t.classpath, t.queue, t.last_error
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object(
            'error', 'Trigger could not be loaded',
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

# A strike: the trigger blocked my ($1) event loop for $4 seconds at attempt $3. One more
# failure; freed to be re-sent, or at $5 quarantined as REAP_DEAD quarantines (the message
# names the class and the block). By (id, attempt) only while I or nobody holds it: my lease
# may have expired during the block, and the reaper may have freed the row already; every
# claim or take-over raises the attempt, so nobody else can be running this attempt. The
# strike raises it too: recorded twice (a retry after a lost answer) it counts once, and an
# event of the struck run no longer applies.
STRIKE = """
WITH struck AS (
    UPDATE trigger t SET owner_id = NULL, attempt = t.attempt + 1, dispatched_at = now(),
        failures = t.failures + 1,
        quarantined_at = CASE WHEN t.failures + 1 >= $5 THEN now() END,
        last_error = format('it blocked the event loop for %s s on consumer %s (%s failures)',
                            round($4::numeric, 1), $1, t.failures + 1)
    WHERE t.id = $2 AND t.attempt = $3 AND (t.owner_id = $1 OR t.owner_id IS NULL)
      AND t.quarantined_at IS NULL
    RETURNING t.id, t.queue, t.classpath, t.failures, t.quarantined_at
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object(
            'error', 'Trigger quarantined',
            'message', format('trigger %s (%s) was quarantined after it blocked the event loop '
                              'for %s s (%s failures)', s.id, s.classpath,
                              round($4::numeric, 1), s.failures),
            'deferred_next_method', ti.next_method, 'deferred_next_kwargs', ti.next_kwargs),
        trigger_timeout = NULL, updated_at = clock_timestamp()
    FROM struck s WHERE s.quarantined_at IS NOT NULL AND ti.trigger_id = s.id
      AND ti.state = 'deferred'
)
SELECT id, queue, classpath, failures, quarantined_at IS NOT NULL AS quarantined FROM struck
"""

# -- writer

# One statement per batch: delete the named triggers, only at the current attempt and of
# the event's own queue (fencing), and move each task that is still deferred on one of them.
APPLY_EVENTS = """
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
                                  WHEN 'fail' THEN '__fail__' END,
        next_kwargs = CASE e.kind
            WHEN 'resume' THEN coalesce(ti.next_kwargs, '{}'::jsonb)
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
    WHERE ti.id = e.ti_id AND ti.trigger_id = e.id AND ti.state = 'deferred'
    RETURNING e.kind, e.queue, extract(epoch FROM clock_timestamp()) - e.fired_at AS latency
)
SELECT kind, queue, latency FROM moved
"""

# The end of both stores' HELD_ELSEWHERE: given ``matching`` (the rows the events name, by
# trigger id) and ``got_row`` (those of them this transaction locked), lock their task rows
# that no other transaction holds and return the events' ids whose rows are held elsewhere.
HELD_TAIL = """, got_task AS MATERIALIZED (
    SELECT ti.trigger_id FROM task_instance ti WHERE ti.trigger_id IN (SELECT id FROM got_row)
    FOR UPDATE SKIP LOCKED
)
SELECT m.id FROM matching m
WHERE m.id NOT IN (SELECT id FROM got_row)
   OR EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = m.id
              AND ti.trigger_id NOT IN (SELECT trigger_id FROM got_task))
"""

# Run before APPLY_EVENTS in one transaction when a team holds locks on its own rows: locks
# what no other transaction holds (SKIP LOCKED: never waits) and returns the events whose
# trigger or task row is held elsewhere; the writer retries those later. Events that match
# no trigger (stale, duplicate) are not held: APPLY_EVENTS ignores them.
HELD_ELSEWHERE = """
WITH ev AS (
    SELECT * FROM unnest($1::bigint[], $2::int[], $3::text[]) AS e(trigger_id, attempt, queue)
), matching AS MATERIALIZED (
    SELECT t.id FROM trigger t JOIN ev
        ON t.id = ev.trigger_id AND t.attempt = ev.attempt AND t.queue = ev.queue
), got_row AS MATERIALIZED (
    SELECT t.id FROM trigger t WHERE t.id IN (SELECT id FROM matching)
    FOR UPDATE SKIP LOCKED
)""" + HELD_TAIL

# -- reaper

# Consumers whose lease expired: free their triggers for re-sending. An ungraceful loss
# counts against the triggers to blame (those on probation if any, else all); a trigger
# blamed alone, or too often, is quarantined and its task failed naming the class.
# A reaping consumer ($5, with room for $6) takes the triggers it may run over in the same
# rewrite: of its queues ($1), not suspects after this loss, not refused by it. Freeing and
# then claiming rewrote every row twice, which made the failover of a million twice as long.
# At most $4 triggers a statement: a consumer that held a million is taken over in batches,
# each started (or re-sent) while the next is rewritten. The dead row stays (locked by each
# batch, so two reapers never free the same triggers) until a batch frees its last trigger.
REAP_DEAD = """
WITH dead AS (
    -- witnessed: another process kept one row valid across this one's expiry with a lease
    -- no longer than this one's, so it wrote to the database during the very lease period
    -- this one failed to renew in. If none did, the database was away for everyone (an
    -- outage fences every consumer at once): no trigger is to blame for that.
    SELECT d.id, d.probation, EXISTS (
               SELECT 1 FROM consumer w
               WHERE w.id <> d.id AND w.expires_at > now() AND w.started_at < d.expires_at
                 AND w.expires_at - w.renewed_at <= d.expires_at - d.renewed_at
           ) AS witnessed
    FROM consumer d
    WHERE d.expires_at < now() AND (d.queues && $1::text[] OR $2)
    FOR UPDATE OF d SKIP LOCKED
), blamed AS (
    -- each dead owner's triggers by trigger_owner (a lateral lookup: a join let the planner
    -- hash all of trigger, a million rows each batch)
    SELECT t.id, t.owner_id, t.queue, t.failures, t.rejected_by,
           d.witnessed AND (cardinality(d.probation) = 0 OR t.id = ANY(d.probation)) AS blame,
           d.probation = ARRAY[t.id] AS alone
    FROM dead d CROSS JOIN LATERAL (
        SELECT t.id, t.owner_id, t.queue, t.failures, t.rejected_by
        FROM trigger t WHERE t.owner_id = d.id LIMIT $4) t
    LIMIT $4
), judged AS (
    SELECT b.id, b.owner_id, b.blame,
           b.blame AND (b.alone OR b.failures + 1 >= $3) AS quarantine,
           $5::bigint IS NOT NULL AND b.queue = ANY($1::text[])
               AND b.failures + b.blame::int < 2
               AND NOT coalesce($5::bigint = ANY(b.rejected_by), false) AS takeable
    FROM blamed b
), fate AS (
    SELECT j.*, j.takeable AND NOT j.quarantine
               AND row_number() OVER (PARTITION BY j.takeable ORDER BY j.id) <= $6 AS take
    FROM judged j
), freed AS (
    UPDATE trigger t SET
        owner_id = CASE WHEN f.take THEN $5::bigint END,
        attempt = t.attempt + f.take::int,
        claimed_at = CASE WHEN f.take THEN now() ELSE t.claimed_at END,
        dispatched_at = now(),
        failures = t.failures + f.blame::int,
        quarantined_at = CASE WHEN f.quarantine THEN now() END,
        last_error = CASE WHEN f.blame
            THEN format('consumer %s died while running it (%s ungraceful losses)',
                        f.owner_id, t.failures + 1)
            ELSE t.last_error END
    -- by trigger_pkey: "= ANY" of the batch's ids, not a hash of the whole table; and only
    -- while the dead consumer still owns it (a claim may have taken it meanwhile)
    FROM fate f WHERE t.id = f.id AND t.owner_id = f.owner_id
      AND t.id = ANY(ARRAY(SELECT id FROM blamed))
    RETURNING t.*, f.take
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object(
            'error', 'Trigger quarantined',
            'message', format('trigger %s (%s) was quarantined after its consumers died %s '
                              'time(s) while running it', f.id, f.classpath, f.failures),
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
TIMEOUT_ORPHANS = """
WITH due AS (
    SELECT ti.id, ti.trigger_id FROM task_instance ti
    WHERE ti.id IN (
        SELECT id FROM task_instance
        WHERE state = 'deferred' AND trigger_timeout < now() - interval '2 seconds'
        UNION ALL
        SELECT id FROM task_instance
        WHERE state = 'deferred' AND trigger_timeout IS NULL
          AND updated_at < now() - make_interval(secs => $3))
      AND ti.state = 'deferred'
      -- past its timeout it is due whoever owns it: a live owner that still runs the
      -- trigger times it out itself at trigger_timeout, so one that has not is not running it
      AND (ti.trigger_timeout < now() - interval '2 seconds'
           OR (ti.trigger_timeout IS NULL AND ti.updated_at < now() - make_interval(secs => $3)
               AND NOT EXISTS (
                   SELECT 1 FROM trigger t JOIN consumer c ON c.id = t.owner_id
                   WHERE t.id = ti.trigger_id AND c.expires_at > now())))
      AND (ti.queue = ANY($1::text[]) OR $2)
    ORDER BY ti.id
    LIMIT 10000
    FOR UPDATE OF ti SKIP LOCKED
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '__fail__',
        next_kwargs = jsonb_build_object('error', 'Trigger timeout',
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
