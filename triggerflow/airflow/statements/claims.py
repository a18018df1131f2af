"""A consumer's statements in Airflow mode (:class:`~triggerflow.store.ClaimStore`,
:class:`~triggerflow.store.ProbationStore`): claim, hand back, probation, strikes."""

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.statements.bookkeeping import AIRFLOW
from triggerflow.airflow.teams import consumer_serves, in_team
from triggerflow.store.interface import SUSPECT_FAILURES
from triggerflow.store.postgres.statements import ownership

MY_LEASE = ownership.MY_LEASE.format(consumer=AIRFLOW.consumer)

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
SELECT {AIRFLOW.claimed.replace("$D", "$4")}
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

# The statements every store runs alike, over Airflow mode's bookkeeping (ownership.py).
(CLAIM_PROBATION, CLEAR_PROBATION, RELEASE, RELEASE_LOST, TAKEN_SINCE, FAIL_UNLOADABLE,
 OTHER_LOADERS, FORGET_HELD, STRIKE) = AIRFLOW.render_all(ownership.CLAIMS)
