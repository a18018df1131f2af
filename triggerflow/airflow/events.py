"""Apply fired triggers' events to Airflow's rows with Airflow's semantics, set-based.

Each statement here does for a whole batch what Airflow does for one event at a time:

* ``resume``  — ``Trigger.submit_event`` / ``handle_event_submit``: ``next_kwargs`` gains
  ``"event"`` (the payload, already Airflow-serde'd by the consumer), state ``scheduled``,
  ``scheduled_dttm`` stamped, ``trigger_id`` cleared;
* ``fail``    — ``Trigger.submit_failure``: ``next_method = '__fail__'``, ``next_kwargs =
  {"error": "Trigger failure", "traceback": [...]}``, state ``scheduled``;
* ``success`` / ``failed`` / ``skipped`` — the task-end events: ``TaskInstance.set_state``
  (start/end dates, duration), their XComs replaced as ``XComModel.set`` does, and for
  success/failed the ``TaskCallbackRequest`` row the DAG processor runs callbacks from.
  A ``TaskFailedEvent`` for a task that may have retries left (``try_number <= max_tries``)
  is left alone here: Airflow 3.3.2 loads the serialized DAG to decide between
  ``up_for_retry`` (with a TaskInstanceHistory row and a new try id) and ``failed``, so those
  few go through Airflow's own function (``orm.apply_with_airflow``).

Fencing: only a task instance still ``deferred`` on that trigger moves, and only for the
attempt triggerflow's bookkeeping says holds the trigger, so redelivered, duplicate or stale
events change nothing. Afterwards ``CLEAN_UNUSED`` deletes the trigger rows nothing uses any
more, as ``Trigger.clean_unused`` would (Airflow's triggerer runs that; without it nobody
does). Dates are the database's: ``scheduled_dttm`` and ``updated_at`` the moment each row is
written (``clock_timestamp()``, as Airflow stamps each event when it handles it, and as native
mode stamps ``updated_at``: a burst's latency then ends when its row was written, not when its
batch's transaction began); the task-end dates one instant per batch (``now()``).

No Airflow import: the writer needs only PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from triggerflow.airflow.schema import SCHEMA
from triggerflow.model import FAIL_METHOD

TASK_END_KINDS = ("success", "failed", "skipped")

# A version-7 UUID (time-ordered, as Airflow's uuid7() ids): PostgreSQL 15 has no uuidv7().
UUID7 = """encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
    substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
    FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid"""


def _json(column: str) -> str:
    """SQL for a column as JSON text, ``null`` for NULL (as pydantic writes None)."""
    return f"coalesce(to_json({column})::text, 'null')"


@dataclass(frozen=True, slots=True)
class AirflowEvent:
    """One fired trigger, as the writer receives it.

    ``body`` is JSON text: for ``resume`` the serde form of the payload, for ``fail`` the whole
    ``next_kwargs``, for task-end kinds ``{"xcoms": {key: serialized value}}`` or ``null``.
    """

    trigger_id: int
    attempt: int
    queue: str
    kind: str
    body: str
    fired_at: float


_APPLY = f"""
WITH event AS (
    SELECT * FROM unnest($1::int[], $2::int[], $3::text[], $4::text[], $5::text[], $6::float8[])
        AS e(trigger_id, attempt, queue, kind, body, fired_at)
    -- only the project's kinds: anything else would become the task's state below
    WHERE e.kind IN ('resume', 'fail', 'success', 'failed', 'skipped')
), live AS MATERIALIZED (
    -- Fenced by attempt, by the trigger's own queue (rows with no queue belong to the
    -- default queue $7) and by the task still deferred on that trigger; the bookkeeping and
    -- task rows locked, so nothing changes them before the UPDATE below. Each event finds
    -- its rows by its own index lookups, in array order, which is id order (apply_events
    -- sorts), so concurrent writers never deadlock. The LATERAL subquery (its FOR UPDATE
    -- keeps it one) fixes that shape: as plain joins, once a burst's clean-up had emptied
    -- trigger and trigger_state and ANALYZE had recorded them so, the planner took the next
    -- burst's rows for one and rescanned the batch once per row (50 million comparisons,
    -- 33-38 s for 5,000 events); stale task_instance statistics did the same to the UPDATE's
    -- join, and a generic plan joined the batch back to itself row by row.
    -- coalesce(): keeps the planner off the ti_state index (all deferred tasks, per event).
    -- A failure of a task that may retry moves nothing here (needs_airflow).
    SELECT event.trigger_id, fenced.ti_id, event.queue, event.kind, event.body::jsonb AS body,
           event.fired_at
    FROM event CROSS JOIN LATERAL (
        SELECT ti.id AS ti_id
        FROM {SCHEMA}.trigger_state s JOIN task_instance ti ON ti.trigger_id = s.trigger_id
        WHERE s.trigger_id = event.trigger_id AND s.attempt = event.attempt
          AND (SELECT coalesce(t.queue, $7) FROM "trigger" t WHERE t.id = event.trigger_id)
              = event.queue
          AND coalesce(ti.state, '') = 'deferred'
          AND NOT (event.kind = 'failed' AND ti.try_number <= ti.max_tries)
        FOR UPDATE OF s, ti
    ) AS fenced
), moved AS (
    UPDATE task_instance ti SET
        state = CASE WHEN live.kind IN ('resume', 'fail') THEN 'scheduled' ELSE live.kind END,
        next_method = CASE WHEN live.kind = 'fail' THEN '{FAIL_METHOD}' ELSE ti.next_method END,
        next_kwargs = CASE live.kind
            WHEN 'resume' THEN coalesce(ti.next_kwargs, '{{}}'::jsonb)
                               || jsonb_build_object('event', live.body)
            WHEN 'fail' THEN live.body
            ELSE ti.next_kwargs END,
        scheduled_dttm = CASE WHEN live.kind IN ('resume', 'fail') THEN clock_timestamp()
                              ELSE ti.scheduled_dttm END,
        start_date = CASE WHEN live.kind IN ('resume', 'fail') THEN ti.start_date
                          ELSE coalesce(ti.start_date, now()) END,
        end_date = CASE WHEN live.kind IN ('resume', 'fail') THEN ti.end_date
                        ELSE coalesce(ti.end_date, now()) END,
        duration = CASE WHEN live.kind IN ('resume', 'fail') THEN ti.duration
                        ELSE extract(epoch FROM coalesce(ti.end_date, now())
                                              - coalesce(ti.start_date, now()))::float8 END,
        trigger_id = NULL,
        updated_at = clock_timestamp()
    FROM live
    -- by primary key alone: live locked these rows still deferred on their trigger
    WHERE ti.id = live.ti_id
    RETURNING ti.id, ti.dag_id, ti.task_id, ti.run_id, ti.map_index, ti.try_number,
              ti.dag_version_id, ti.hostname, ti.context_carrier, ti.queue AS ti_queue,
              live.trigger_id, live.queue,
              live.kind, live.body, extract(epoch FROM clock_timestamp()) - live.fired_at AS latency
), detached AS (
    -- Trigger.clean_unused's first step, for this batch's triggers: a task no longer
    -- deferred (cleared, marked by hand) lets go of its trigger. Found per trigger id by
    -- the ti_trigger_id index (the LATERAL's FOR UPDATE keeps it one): as a plain
    -- `trigger_id = ANY($1)`, statistics that undercount task_instance (taken while it was
    -- nearly empty, or right after `airflow db clean`) made every batch read the whole table.
    UPDATE task_instance ti SET trigger_id = NULL, updated_at = now()
    FROM (SELECT stale.id FROM unnest($1::int[]) AS batch(trigger_id)
          CROSS JOIN LATERAL (
              SELECT t.id FROM task_instance t
              WHERE t.trigger_id = batch.trigger_id AND t.state <> 'deferred'
              FOR UPDATE
          ) AS stale) AS let_go
    WHERE ti.id = let_go.id
), called_back AS (
    -- The TaskCallbackRequest Airflow's DatabaseCallbackSink stores for a task ended by its
    -- trigger as success or failed: BaseSerialization's dict wrapping a pydantic JSON text.
    INSERT INTO callback (id, type, fetch_method, data, bundle_name, priority_weight, created_at)
    SELECT {UUID7}, 'dag_processor', 'dag_attribute',
           jsonb_build_object('__type', 'dict', '__var', jsonb_build_object(
               'req_class', 'TaskCallbackRequest',
               'req_data', concat(
                   '{{"filepath":', {_json("d.relative_fileloc")},
                   ',"bundle_name":', {_json("d.bundle_name")},
                   ',"bundle_version":', {_json("dr.bundle_version")},
                   ',"msg":null,"ti":{{"id":', {_json("moved.id")},
                   ',"task_id":', {_json("moved.task_id")},
                   ',"dag_id":', {_json("moved.dag_id")},
                   ',"run_id":', {_json("moved.run_id")},
                   ',"try_number":', {_json("moved.try_number")},
                   ',"dag_version_id":', {_json("moved.dag_version_id")},
                   ',"map_index":', {_json("moved.map_index")},
                   ',"hostname":', {_json("moved.hostname")},
                   ',"context_carrier":', {_json("moved.context_carrier")},
                   {{ti_queue}}
                   '}},"task_callback_type":', to_json(moved.kind),
                   ',"context_from_server":null,"type":"TaskCallbackRequest"}}'))),
           d.bundle_name, 1, now()
    FROM moved
    JOIN dag d ON d.dag_id = moved.dag_id
    JOIN dag_run dr ON dr.dag_id = moved.dag_id AND dr.run_id = moved.run_id
    WHERE moved.kind IN ('success', 'failed')
), pushed AS (
    INSERT INTO xcom (dag_run_id, task_id, map_index, key, dag_id, run_id, value, "timestamp"
                      {{xcom_columns}})
    SELECT dr.id, moved.task_id, moved.map_index, x.key, moved.dag_id, moved.run_id, x.value,
           now() {{xcom_values}}
    FROM moved
    JOIN dag_run dr ON dr.dag_id = moved.dag_id AND dr.run_id = moved.run_id
    CROSS JOIN LATERAL jsonb_each(moved.body -> 'xcoms') AS x(key, value)
    WHERE moved.kind IN {TASK_END_KINDS!r} AND jsonb_typeof(moved.body -> 'xcoms') = 'object'
    ON CONFLICT (dag_run_id, task_id, map_index, key)
        DO UPDATE SET value = EXCLUDED.value, "timestamp" = EXCLUDED."timestamp"
                      {{xcom_updates}}
)
SELECT trigger_id, queue, kind, latency FROM moved
"""


def _apply_for(release: str) -> str:
    """``APPLY`` as Airflow ``release`` writes its rows. 3.3 over 3.2: ``xcom.dag_result``
    (migration 0110; ``XComModel.set`` writes false there) and the ``queue`` of the task in a
    ``TaskCallbackRequest``'s ``ti`` (3.2's model has none)."""
    three_three = release == "3.3"
    parts = {
        "{xcom_columns}": ", dag_result" if three_three else "",
        "{xcom_values}": ", false" if three_three else "",
        "{xcom_updates}": ", dag_result = EXCLUDED.dag_result" if three_three else "",
        "{ti_queue}": f"""',"queue":', {_json("moved.ti_queue")},""" if three_three else "",
    }
    sql = _APPLY
    for marker, text in parts.items():
        sql = sql.replace(marker, text)
    return sql


# Airflow release (schema.KNOWN_AIRFLOW_REVISIONS) -> its APPLY.
APPLY_FOR = {release: _apply_for(release) for release in ("3.3", "3.2")}
APPLY = APPLY_FOR["3.3"]

# Trigger.clean_unused for the triggers of a batch: rows no task instance, asset watcher or
# callback refers to. (task_instance.trigger_id cascades on delete, so the NOT EXISTS is what
# keeps a still-deferred task alive.) triggerflow's bookkeeping for them goes too.
CLEAN_UNUSED = f"""
WITH gone AS (
    DELETE FROM "trigger" t
    WHERE t.id = ANY($1::int[])
      AND NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM callback cb WHERE cb.trigger_id = t.id)
    RETURNING t.id
)
DELETE FROM {SCHEMA}.trigger_state s USING gone WHERE s.trigger_id = gone.id
"""


def needs_airflow(events: Sequence[AirflowEvent], moved: set[int]) -> list[AirflowEvent]:
    """Events ``APPLY`` left for Airflow's own code: failures of tasks that may retry."""
    return [e for e in events if e.kind == "failed" and e.trigger_id not in moved]


async def apply_events(conn: asyncpg.Connection, events: Sequence[AirflowEvent],
                       default_queue: str | None = None, *,
                       clean: bool = True, release: str = "3.3") -> list[asyncpg.Record]:
    """Apply a batch in one transaction (two statements; one without ``clean``, when the
    caller runs ``CLEAN_UNUSED`` for these triggers later); returns a row per task that moved
    (``trigger_id``, ``queue``, ``kind``, ``latency`` seconds from fire to apply)."""
    if not events:
        return []
    # In trigger id order: APPLY locks in the order it is given (the writer's batches come
    # sorted already, so this costs a pass over a sorted list).
    events = sorted(events, key=lambda e: e.trigger_id)
    async with conn.transaction():
        rows: list[asyncpg.Record] = await conn.fetch(
            APPLY_FOR[release],
            [e.trigger_id for e in events], [e.attempt for e in events],
            [e.queue for e in events], [e.kind for e in events], [e.body for e in events],
            [e.fired_at for e in events], default_queue,
        )
        if clean:
            await conn.execute(CLEAN_UNUSED, sorted({e.trigger_id for e in events}))
    return rows
