"""The lease statements of Airflow mode: native mode's, on the ``triggerflow`` schema; only
``register`` (it records the Airflow team filter the process applies, ``teams.py``), the
rebalancing peers of ``renew`` (of my team only) and ``unregister`` (it frees the bookkeeping
rows, ``trigger_state``) are its own."""

import dataclasses

from triggerflow.airflow.schema import SCHEMA
from triggerflow.store.postgres.statements.lease import lease_statements

# A peer for rebalancing also applies my team filter: a consumer of another Airflow team on the
# same queues cannot take what I shed, so counted it would make me shed for ever.
_SAME_TEAM = f"""
           AND c.team IS NOT DISTINCT FROM (SELECT m.team FROM {SCHEMA}.consumer m WHERE m.id = $1)
           AND c.team_scoped = (SELECT m.team_scoped FROM {SCHEMA}.consumer m WHERE m.id = $1)"""

LEASE = dataclasses.replace(lease_statements(
    f"{SCHEMA}.consumer",
    f"""
WITH stragglers AS (
    UPDATE {SCHEMA}.trigger_state SET owner_id = NULL, published_at = now() - interval '1 day'
    WHERE owner_id = $1 RETURNING trigger_id
)
DELETE FROM {SCHEMA}.consumer WHERE id = $1
""",
    peers=_SAME_TEAM,
), register=f"""
INSERT INTO {SCHEMA}.consumer (kind, host, pid, queues, capacity, version, expires_at, subscribed,
                               team, team_scoped)
VALUES ($1, $2, $3, $4::text[], $5, $6, now() + make_interval(secs => $7), false, $8, $9)
RETURNING id
""")
