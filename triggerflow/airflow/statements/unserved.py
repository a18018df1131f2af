"""Trigger rows that nothing serves: no live consumer can run them and no live Airflow
triggerer holds them (``status --airflow``, the writer's heartbeat and its
``triggerflow_unserved_triggers`` gauge).

A row with work (``nontask.LIVE``: a deferred task, an asset watcher, a callback) is unserved
when no live consumer owns it, no live Airflow triggerer holds it (``trigger.triggerer_id``:
Airflow's own triggerer, during a migration, assigns rows that way), and

* ``no-queue``: it has no queue and there is no ``--default-queue``. Airflow 3.3.2's
  ``airflow triggerer --queues ...`` never takes such a row (``Trigger.get_sorted_triggers``
  filters ``queue IN (...)``); only a triggerer started without ``--queues`` does;
* ``no-consumer``: no live consumer subscribed on the broker serves its queue and its Airflow
  team (``trigger.team_name``, 3.3: a consumer started with ``--team T`` under ``[core]
  multi_team`` serves only rows of T, one without ``--team`` only rows of no team, one with
  multi_team off every row; each consumer's row records which, ``teams.py``);
* ``unloadable``: every live consumer of its queue and team refused it (could not import its class:
  ``trigger_state.rejected_by``), read from the unowned bookkeeping's partial index.

On a healthy deployment the first branch keeps nothing past its queue test, and the second
reads only unowned bookkeeping rows: the scan is of ``trigger`` alone, as before.
``$1`` is the default queue (NULL: none). The statements' team markers are written out for
the installed Airflow at import (``rendered``: 3.2's rows have no team).
"""

import functools

from triggerflow.airflow.nontask import LIVE
from triggerflow.airflow.schema import SCHEMA
from triggerflow.airflow.teams import consumer_serves, installed_has_teams, render, team_of

# What the queue label says for a row with no queue (no default queue): a Prometheus label
# and a status line need a value, and no Airflow queue is spelled this way.
NO_QUEUE = "(no queue)"

# Reasons, as the gauge's ``reason`` label and status's lines name them.
REASONS = {
    "no-queue": "no queue and no --default-queue (a consumer serves only its --queue queues, "
                "as `airflow triggerer --queues` does)",
    "no-consumer": "no live consumer of the queue",
    "unloadable": "every live consumer of the queue refused its class",
}

# Airflow's triggerer is alive while its heartbeat is younger than [triggerer]
# triggerer_health_check_threshold (30 s by default); Trigger.assign_unassigned takes rows
# back from one past it.
AIRFLOW_TRIGGERER_ALIVE = "30 seconds"

NAMED = 5  # rows status names per queue and reason

_HELD_ELSEWHERE = f"""NOT EXISTS (
        SELECT 1 FROM job j WHERE j.id = t.triggerer_id AND j.job_type = 'TriggererJob'
          AND j.state = 'running' AND j.end_date IS NULL
          AND j.latest_heartbeat > now() - interval '{AIRFLOW_TRIGGERER_ALIVE}')"""

# A live consumer serves the row's queue and team: one that filters no team (team NULL here),
# or one of the row's team ('' for none: no Airflow team is spelled so). Two hashed lookups
# per row, as the single queue lookup was.
_SERVED = f"""(coalesce(t.queue, $1) IN (SELECT queue FROM live WHERE team IS NULL)
       OR (coalesce(t.queue, $1), {team_of("t")})
          IN (SELECT queue, team FROM live WHERE team IS NOT NULL))"""

# Columns: id, queue (NO_QUEUE for none), team (NULL: none), reason, kind, classpath,
# created_date.
UNSERVED_ROWS = f"""
WITH live AS (
    SELECT DISTINCT unnest(queues) AS queue,
           CASE WHEN team_scoped THEN coalesce(team, '') END AS team
    FROM {SCHEMA}.consumer
    WHERE kind = 'consumer' AND expires_at > now() AND subscribed
), candidate AS (
    SELECT t.id, t.queue, t.classpath, t.created_date, t.triggerer_id,
           nullif({team_of("t")}, '') AS team,
           CASE WHEN coalesce(t.queue, $1) IS NULL THEN 'no-queue' ELSE 'no-consumer' END
               AS reason
    FROM "trigger" t
    WHERE (coalesce(t.queue, $1) IS NULL OR NOT {_SERVED})
      AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.trigger_state s JOIN {SCHEMA}.consumer o
                      ON o.id = s.owner_id
                      WHERE s.trigger_id = t.id AND o.expires_at > now())
    UNION ALL
    SELECT t.id, t.queue, t.classpath, t.created_date, t.triggerer_id,
           nullif({team_of("t")}, ''), 'unloadable'
    FROM {SCHEMA}.trigger_state s JOIN "trigger" t ON t.id = s.trigger_id
    WHERE s.owner_id IS NULL AND s.quarantined_at IS NULL AND cardinality(s.rejected_by) > 0
      AND {_SERVED}
      AND NOT EXISTS (SELECT 1 FROM {SCHEMA}.consumer c
                      WHERE c.kind = 'consumer' AND c.expires_at > now()
                        AND coalesce(t.queue, $1) = ANY(c.queues)
                        AND NOT (c.id = ANY(s.rejected_by)) AND {consumer_serves("c", "t")})
)
SELECT t.id, coalesce(t.queue, $1, '{NO_QUEUE}') AS queue, t.team, t.reason, t.classpath,
       t.created_date,
       CASE WHEN EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
                THEN 'asset watcher'
            WHEN EXISTS (SELECT 1 FROM callback cb WHERE cb.trigger_id = t.id) THEN 'callback'
            ELSE 'task' END AS kind
FROM candidate t
WHERE {_HELD_ELSEWHERE} AND {LIVE}
"""

_WHY = " ".join(f"WHEN '{reason}' THEN '{why}'" for reason, why in REASONS.items())

# status --airflow: per (queue, team, reason) the count and the first NAMED rows by id; $2
# seconds a row may wait unserved first (a lease period: Airflow's triggerer or a starting
# consumer takes it).
STATUS_UNSERVED = f"""
SELECT queue, team, reason, CASE reason {_WHY} END AS why, id, kind, classpath, total FROM (
    SELECT u.*, row_number() OVER (PARTITION BY queue, team, reason ORDER BY id) AS nth,
           count(*) OVER (PARTITION BY queue, team, reason) AS total
    FROM ({UNSERVED_ROWS}) u
    WHERE u.created_date < now() - make_interval(secs => $2)
) named
WHERE nth <= {NAMED}
ORDER BY queue, team NULLS FIRST, reason, id
"""


@functools.cache
def rendered(sql: str) -> str:
    """``sql`` (a statement built on ``UNSERVED_ROWS``) for the installed Airflow's rows."""
    return render(sql, scoped=False, has_teams=installed_has_teams())


UNSERVED_ROWS = rendered(UNSERVED_ROWS)
STATUS_UNSERVED = rendered(STATUS_UNSERVED)
