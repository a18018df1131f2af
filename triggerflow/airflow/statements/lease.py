"""The lease statements of Airflow mode: native mode's, on the ``triggerflow`` schema; only
``unregister`` is its own (it frees the bookkeeping rows, ``trigger_state``)."""

from triggerflow.airflow.schema import SCHEMA
from triggerflow.store.postgres.statements.lease import lease_statements

LEASE = lease_statements(
    f"{SCHEMA}.consumer",
    f"""
WITH stragglers AS (
    UPDATE {SCHEMA}.trigger_state SET owner_id = NULL, published_at = now() - interval '1 day'
    WHERE owner_id = $1 RETURNING trigger_id
)
DELETE FROM {SCHEMA}.consumer WHERE id = $1
""",
)
