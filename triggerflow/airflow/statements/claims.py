"""A consumer's statements in Airflow mode (:class:`~triggerflow.store.ClaimStore`,
:class:`~triggerflow.store.ProbationStore`): claim, hand back, probation, strikes."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.teams import consumer_serves, in_team
from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.store.interface import SUSPECT_FAILURES


def fail_quarantined(rows: str) -> str:
    """Fail the tasks of the rows of CTE ``rows`` quarantined just now (``trigger_id``,
    ``quarantined``, ``last_error``), the way Airflow fails a trigger
    (``Trigger.submit_failure``: '__fail__', 'Trigger failure', the reason as its traceback)."""
    return f"""
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_FAILURE}',
            'traceback', jsonb_build_array(format('triggerflow quarantined this trigger: %s',
                                                  f.last_error))),
        trigger_id = NULL, scheduled_dttm = now(), updated_at = now()
    FROM {rows} f WHERE f.quarantined AND ti.trigger_id = f.trigger_id AND ti.state = 'deferred'
"""


# What a consumer needs to run a claimed trigger: Airflow's classpath and encrypted kwargs,
# the team queue, the task for log lines, and how long ago the task deferred (the API server
# writes created_date with the deferral: the scheduler race's clock). Timeouts stay the
# scheduler's (as in Airflow).
SPEC = """
    t.id, c.attempt, t.classpath, t.kwargs, coalesce(t.queue, $4) AS queue,
    CASE WHEN ti.id IS NOT NULL THEN format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id)
    END AS task,  -- NULL: an asset watcher's or a callback's row (airflow/watchers.py)
    extract(epoch FROM clock_timestamp() - t.created_date)::float8 AS deferred_for
"""

# One statement: Airflow's trigger rows of my queues that a deferred task waits on, joined
# with triggerflow's bookkeeping (absent the first time), claimed where no live owner holds
# them. The upsert takes the bookkeeping row's lock: a concurrent claim of the same id waits,
# then finds a live owner and claims nothing. Asset-watcher and callback rows (no task; no
# queue, so only with a default queue) are claimed too (nontask.LIVE).
# Only rows of my Airflow team ($5, teams.py), as `airflow triggerer --team-name` takes them.
# Each delivered id finds its rows by its own index lookups: the LATERAL subquery, kept one
# by OFFSET 0 (as events.APPLY's by its FOR UPDATE). As plain joins, statistics taken right
# after a burst's clean-up had emptied trigger and trigger_state let the planner read those
# tables whole for every claim (tests/test_airflow_store.py counts the rows a claim reads).
# The claimer's own live lease row, key-share locked (why: the native MY_LEASE).
MY_LEASE = f"""me AS (
    SELECT id FROM {SCHEMA}.consumer WHERE id = $1 AND expires_at > now() FOR KEY SHARE)"""

CLAIM = f"""
WITH {MY_LEASE}, candidate AS MATERIALIZED (
    SELECT c.* FROM (SELECT DISTINCT unnest($2::int[]) AS id) AS want CROSS JOIN LATERAL (
        SELECT t.id, coalesce(t.queue, $4) AS queue, coalesce(s.failures, 0) AS failures,
               coalesce($1 = ANY(s.rejected_by), false) AS refused,
               s.owner_id IS NULL AS unowned, {in_team("t.team_name", 5)} AS ours
        FROM "trigger" t
        LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
        WHERE t.id = want.id AND coalesce(t.queue, $4) = ANY($3::text[])
          AND s.quarantined_at IS NULL
          -- held by a live owner: not mine, not a suspect waiting for probation (as native)
          AND (s.owner_id IS NULL OR NOT EXISTS (
                SELECT 1 FROM {SCHEMA}.consumer o
                WHERE o.id = s.owner_id AND o.expires_at > now()))
          AND {LIVE} AND EXISTS (SELECT 1 FROM me)
        OFFSET 0
    ) AS c
), claimed AS (
    INSERT INTO {SCHEMA}.trigger_state AS s (trigger_id, owner_id, attempt, claimed_at)
    SELECT id, $1, 1, now() FROM candidate
    WHERE ours AND failures < {SUSPECT_FAILURES} AND NOT refused ORDER BY id
    ON CONFLICT (trigger_id) DO UPDATE
        SET owner_id = $1, attempt = s.attempt + 1, claimed_at = now()
        WHERE s.quarantined_at IS NULL AND s.failures < {SUSPECT_FAILURES} AND NOT ($1 = ANY(s.rejected_by))
          AND (s.owner_id IS NULL OR NOT EXISTS (
                SELECT 1 FROM {SCHEMA}.consumer o
                WHERE o.id = s.owner_id AND o.expires_at > now()))
    RETURNING s.trigger_id, s.attempt
)
SELECT {SPEC}, 'claimed' AS outcome
FROM claimed c JOIN "trigger" t ON t.id = c.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND coalesce(ti.state, '') = 'deferred'
UNION ALL
SELECT id, 0, '', '', queue, NULL, NULL, 'suspect' FROM candidate
WHERE ours AND failures >= {SUSPECT_FAILURES} AND NOT refused
UNION ALL
SELECT id, 0, '', '', queue, NULL, NULL, 'refused' FROM candidate WHERE ours AND refused AND unowned
UNION ALL
-- Another team's row (free, or held by a dead owner), delivered here because the broker
-- shares a queue's wake-ups among all its consumers: to be handed on while a live,
-- subscribed consumer of that team serves the queue.
SELECT c.id, 0, '', '', c.queue, NULL, NULL, 'elsewhere'
FROM candidate c JOIN "trigger" t ON t.id = c.id
WHERE NOT c.ours AND EXISTS (
    SELECT 1 FROM {SCHEMA}.consumer o
    WHERE o.kind = 'consumer' AND o.expires_at > now() AND o.subscribed AND NOT o.warming
      AND c.queue = ANY(o.queues) AND {consumer_serves("o", "t")})
"""

CLAIM_PROBATION = f"""
WITH {MY_LEASE}, worst AS (
    SELECT s.failures AS f, count(*) AS n
    FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id
    WHERE coalesce(t.queue, $3) = ANY($2::text[]) AND s.owner_id IS NULL
      AND s.quarantined_at IS NULL AND s.failures >= {SUSPECT_FAILURES}
      AND {in_team("t.team_name", 5)}
    GROUP BY s.failures ORDER BY s.failures DESC LIMIT 1
), candidate AS (
    SELECT s.trigger_id FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id,
         worst
    WHERE coalesce(t.queue, $3) = ANY($2::text[]) AND s.owner_id IS NULL
      AND s.quarantined_at IS NULL AND s.failures = worst.f AND NOT ($1 = ANY(s.rejected_by))
      AND {in_team("t.team_name", 5)} AND EXISTS (SELECT 1 FROM me)
    ORDER BY s.trigger_id
    LIMIT (SELECT least(greatest(1, (n + 1) / 2), $4::int) FROM worst)
    FOR UPDATE OF s SKIP LOCKED
), claimed AS (
    UPDATE {SCHEMA}.trigger_state s SET owner_id = $1, attempt = s.attempt + 1,
           claimed_at = now()
    FROM candidate WHERE s.trigger_id = candidate.trigger_id
    RETURNING s.trigger_id, s.attempt
), on_probation AS (
    UPDATE {SCHEMA}.consumer
    SET probation = (SELECT coalesce(array_agg(trigger_id), '{{}}') FROM claimed)
    WHERE id = $1
)
SELECT t.id, c.attempt, t.classpath, t.kwargs, coalesce(t.queue, $3) AS queue,
       CASE WHEN ti.id IS NOT NULL THEN format('%s.%s@%s', ti.dag_id, ti.task_id, ti.run_id)
       END AS task,  -- NULL: an asset watcher's or a callback's row (airflow/watchers.py)
       extract(epoch FROM clock_timestamp() - t.created_date)::float8 AS deferred_for
FROM claimed c JOIN "trigger" t ON t.id = c.trigger_id
LEFT JOIN task_instance ti ON ti.trigger_id = t.id AND ti.state = 'deferred'
"""

CLEAR_PROBATION = f"""
WITH cleared AS (
    UPDATE {SCHEMA}.trigger_state SET failures = 0
    WHERE trigger_id = ANY($2::int[]) AND owner_id = $1 RETURNING trigger_id
)
UPDATE {SCHEMA}.consumer SET probation = '{{}}' WHERE id = $1
"""

RELEASE = f"""
UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, published_at = now(),
       rejected_by = CASE WHEN $3 THEN s.rejected_by || $1::bigint ELSE s.rejected_by END,
       last_error = coalesce($4, s.last_error)
FROM "trigger" t
WHERE t.id = s.trigger_id AND s.owner_id = $1
  AND ($2::int[] IS NULL OR s.trigger_id = ANY($2::int[]))
RETURNING s.trigger_id AS id, coalesce(t.queue, $5) AS queue
"""

# Reconcile: rows I fired but still own at that attempt lost their event; free them.
RELEASE_LOST = f"""
UPDATE {SCHEMA}.trigger_state s SET owner_id = NULL, published_at = now()
FROM "trigger" t, unnest($2::int[], $3::int[]) AS lost(id, attempt)
WHERE t.id = s.trigger_id AND s.trigger_id = lost.id AND s.attempt = lost.attempt
  AND s.owner_id = $1
RETURNING s.trigger_id AS id, coalesce(t.queue, $4) AS queue
"""

# What a claim whose reply never came may have made mine (read only after such a failure).
TAKEN_SINCE = f"""
SELECT trigger_id AS id, attempt FROM {SCHEMA}.trigger_state
WHERE owner_id = $1 AND claimed_at >= now() - make_interval(secs => $2)
"""

# Refused triggers no other live consumer may load (of their queue and their team): fail their
# tasks naming the class.
FAIL_UNLOADABLE = f"""
WITH gone AS (
    DELETE FROM {SCHEMA}.trigger_state s USING "trigger" t
    WHERE t.id = s.trigger_id AND s.trigger_id = ANY($1::int[]) AND s.owner_id IS NULL
      AND $2::bigint = ANY(s.rejected_by)
      AND NOT EXISTS (
          SELECT 1 FROM {SCHEMA}.consumer c
          WHERE c.kind = 'consumer' AND c.expires_at > now()
            AND coalesce(t.queue, $3) = ANY(c.queues) AND NOT (c.id = ANY(s.rejected_by))
            AND {consumer_serves("c", "t")})
    RETURNING s.trigger_id, t.classpath, coalesce(t.queue, $3) AS queue, s.last_error
), failed AS (
    UPDATE task_instance ti SET state = 'scheduled', next_method = '{FAIL_METHOD}',
        next_kwargs = jsonb_build_object(
            'error', '{FailureReason.TRIGGER_FAILURE}',
            'traceback', jsonb_build_array(format(
                'triggerflow: no live consumer of queue %s can load %s (%s)',
                g.queue, g.classpath, coalesce(g.last_error, 'unknown')))),
        trigger_id = NULL, scheduled_dttm = now(), updated_at = now()
    FROM gone g WHERE ti.trigger_id = g.trigger_id AND ti.state = 'deferred'
)
SELECT trigger_id AS id FROM gone
"""

OTHER_LOADERS = f"""
SELECT count(*) FROM {SCHEMA}.consumer c, "trigger" t
LEFT JOIN {SCHEMA}.trigger_state s ON s.trigger_id = t.id
WHERE t.id = $1 AND c.kind = 'consumer' AND c.expires_at > now()
  AND coalesce(t.queue, $3) = ANY(c.queues)
  AND NOT (c.id = ANY(coalesce(s.rejected_by, '{{}}'))) AND c.id <> $2
  AND {consumer_serves("c", "t")}
"""

FORGET_HELD = f"""
DELETE FROM {SCHEMA}.trigger_state WHERE trigger_id = ANY($1::int[]) AND owner_id = $2
"""

# A strike against a trigger that blocked my event loop, counted by run whoever holds it
# now and fenced by my queues ($7), as the native STRIKE (why is said there); quarantined
# at $5 blocked runs as REAP_DEAD quarantines.
STRIKE = f"""
WITH target AS (
    SELECT s.trigger_id, cardinality(s.blocked_attempts) + 1 >= $5 AS quarantine,
           cardinality(s.blocked_attempts) + 1 >= $5
               OR (s.attempt = $3 AND (s.owner_id = $1 OR s.owner_id IS NULL)) AS release
    FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id
    WHERE s.trigger_id = $2 AND coalesce(t.queue, $6) = ANY($7::text[])
      AND s.quarantined_at IS NULL AND $3 <= s.attempt AND NOT ($3 = ANY(s.blocked_attempts))
    FOR UPDATE OF s
), struck AS (
    UPDATE {SCHEMA}.trigger_state s SET
        blocked_attempts = s.blocked_attempts || $3::int,
        owner_id = CASE WHEN g.release THEN NULL ELSE s.owner_id END,
        attempt = s.attempt + g.release::int,
        published_at = CASE WHEN g.release THEN now() ELSE s.published_at END,
        quarantined_at = CASE WHEN g.quarantine THEN now() END,
        last_error = format('trigger %s (%s) blocked the event loop for %s s on consumer %s '
                            '(%s runs blocked)', t.id, t.classpath, round($4::numeric, 1), $1,
                            cardinality(s.blocked_attempts) + 1)
    FROM target g, "trigger" t
    WHERE s.trigger_id = g.trigger_id AND t.id = s.trigger_id
    RETURNING s.trigger_id, coalesce(t.queue, $6) AS queue, t.classpath,
              cardinality(s.blocked_attempts) AS blocks,
              s.quarantined_at IS NOT NULL AS quarantined, s.last_error, g.release
), failed AS ({fail_quarantined("struck")})
SELECT trigger_id AS id, queue, classpath, blocks, quarantined, release AND NOT quarantined AS freed
FROM struck
"""
