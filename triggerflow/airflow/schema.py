"""DDL of triggerflow's own schema inside Airflow's database, and the Airflow schema versions
it was written against.

Nothing here alters Airflow's tables except ``NOTIFY_TRIGGER``: an AFTER INSERT trigger on
Airflow's ``trigger`` table. It is statement-level (one NOTIFY per 500 ids of a queue, not one
per row) because a bulk insert of 10,000 rows must not queue 10,000 notifications.
"""

from __future__ import annotations

SCHEMA = "triggerflow"
NOTIFY_CHANNEL = "triggerflow_airflow_trigger"
SCHEMA_VERSION = 8  # 5: the cancel log (cancels.py); 6: consumer.warming;
# 7: trigger_state.blocked_attempts; 8: consumer.team, consumer.team_scoped (teams.py)

# Airflow release -> head of its alembic migrations (``alembic_version.version_num``).
# The SQL in this package was checked against these; anything else is refused.
KNOWN_AIRFLOW_REVISIONS: dict[str, str] = {
    "3.3": "d2f4e1b3c5a7",  # heads of 3.3.0 .. 3.3.2 (airflow.utils.db._REVISION_HEADS_MAP)
    "3.2": "1d6611b6ab7c",  # heads of 3.2.0 .. 3.2.2: no xcom.dag_result (events.APPLY_FOR)
}



def installed_release() -> str:
    """The Airflow minor installed beside triggerflow ("3.3"), read without importing it: where
    Airflow's triggerer itself differs between minors, triggerflow does as the installed one."""
    from importlib.metadata import version

    return ".".join(version("apache-airflow-core").split(".")[:2])


# Ids per notification: a NOTIFY payload must stay under 8,000 bytes.
NOTIFY_CHUNK = 500

CREATE = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};

CREATE TABLE IF NOT EXISTS {SCHEMA}.meta (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    schema_version integer NOT NULL,
    airflow_revision text NOT NULL,
    installed_at timestamptz NOT NULL DEFAULT now()
);

-- A consumer or writer process; its lease is this row (renewed once per interval).
CREATE TABLE IF NOT EXISTS {SCHEMA}.consumer (
    id bigserial PRIMARY KEY,
    kind text NOT NULL,
    host text NOT NULL,
    pid integer NOT NULL,
    queues text[] NOT NULL DEFAULT '{{}}',
    capacity integer NOT NULL DEFAULT 0,
    version text NOT NULL DEFAULT '',
    running integer NOT NULL DEFAULT 0,
    probation bigint[] NOT NULL DEFAULT '{{}}',
    registered_at timestamptz NOT NULL DEFAULT now(),
    renewed_at timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL,
    -- subscribed on the broker as of its last renewal: only then is it counted as capacity
    -- (registrations write false; true is for rows of processes older than the column)
    subscribed boolean NOT NULL DEFAULT true,
    -- its clock minus the database's, seconds, as it last measured (NULL: not yet)
    clock_skew double precision,
    -- waiting for its trigger runtime beside a peer, unsubscribed on purpose (status)
    warming boolean NOT NULL DEFAULT false
);
-- schema versions 2-4: a schema set up earlier gains the columns in place
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS subscribed boolean NOT NULL DEFAULT true;
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS clock_skew double precision;
-- schema version 4: the broker presence queue of the consumer's current connection (null:
-- unknown, the lease alone decides)
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS presence text;
-- schema version 6: a consumer warming up is unsubscribed on purpose (status, gauges)
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS warming boolean NOT NULL DEFAULT false;
-- schema version 8: the Airflow team filter a consumer applies (teams.py): team_scoped, it
-- takes only rows whose trigger.team_name is team (NULL: rows of no team); else every row
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS team text;
ALTER TABLE {SCHEMA}.consumer ADD COLUMN IF NOT EXISTS team_scoped boolean NOT NULL DEFAULT false;

-- Bookkeeping per Airflow trigger row (keyed by Airflow's trigger.id, no foreign key: a
-- foreign key would put triggers of ours on Airflow's table; orphans are reaped instead).
CREATE TABLE IF NOT EXISTS {SCHEMA}.trigger_state (
    trigger_id integer PRIMARY KEY,
    owner_id bigint,
    attempt integer NOT NULL DEFAULT 0,
    claimed_at timestamptz,
    published_at timestamptz,
    failures integer NOT NULL DEFAULT 0,
    rejected_by bigint[] NOT NULL DEFAULT '{{}}',
    quarantined_at timestamptz,
    last_error text,
    -- the runs (attempts) in which it blocked its consumer's event loop (strikes.py)
    blocked_attempts integer[] NOT NULL DEFAULT '{{}}'
);
-- schema version 7: a schema set up earlier gains the column in place
ALTER TABLE {SCHEMA}.trigger_state
    ADD COLUMN IF NOT EXISTS blocked_attempts integer[] NOT NULL DEFAULT '{{}}';
CREATE INDEX IF NOT EXISTS trigger_state_blocker_owner ON {SCHEMA}.trigger_state (owner_id)
    WHERE cardinality(blocked_attempts) > 0;
CREATE INDEX IF NOT EXISTS trigger_state_owner ON {SCHEMA}.trigger_state (owner_id)
    WHERE owner_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS trigger_state_unowned ON {SCHEMA}.trigger_state (published_at)
    WHERE owner_id IS NULL AND quarantined_at IS NULL;

CREATE OR REPLACE FUNCTION {SCHEMA}.notify_trigger_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    batch record;
BEGIN
    FOR batch IN
        SELECT queue, array_agg(id ORDER BY id) AS ids
        FROM (SELECT id, queue,
                     (row_number() OVER (PARTITION BY queue ORDER BY id) - 1) / {NOTIFY_CHUNK} AS chunk
              FROM new_rows) numbered
        GROUP BY queue, chunk
    LOOP
        PERFORM pg_notify('{NOTIFY_CHANNEL}',
                          json_build_object('queue', batch.queue, 'ids', batch.ids)::text);
    END LOOP;
    RETURN NULL;
END
$$;
"""

NOTIFY_TRIGGER = f"""
CREATE OR REPLACE TRIGGER triggerflow_notify_insert
AFTER INSERT ON "trigger"
REFERENCING NEW TABLE AS new_rows
FOR EACH STATEMENT EXECUTE FUNCTION {SCHEMA}.notify_trigger_insert()
"""

RECORD_META = f"""
INSERT INTO {SCHEMA}.meta (schema_version, airflow_revision) VALUES ($1, $2)
ON CONFLICT (singleton) DO UPDATE
SET schema_version = EXCLUDED.schema_version, airflow_revision = EXCLUDED.airflow_revision
"""

DROP = f"""
DROP TRIGGER IF EXISTS triggerflow_notify_insert ON "trigger";
DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
"""

AIRFLOW_REVISION = "SELECT version_num FROM alembic_version"

INSTALLED = f"""
SELECT
    (SELECT count(*) FROM pg_namespace WHERE nspname = '{SCHEMA}') AS schemas,
    (SELECT count(*) FROM pg_trigger WHERE tgname = 'triggerflow_notify_insert'
        AND tgrelid = '"trigger"'::regclass) AS notify_triggers
"""
