"""The few events applied with Airflow's own function instead of set-based SQL.

A ``TaskFailedEvent`` for a task that may retry: Airflow 3.3.2's handler loads the serialized
DAG to decide between ``up_for_retry`` and ``failed`` and archives the try; re-implementing
that would drift from Airflow. These are rare (a trigger ending its task as failed), so each
is applied in its own ORM session, fenced the same way as the batch (attempt, queue, task
still deferred), exactly as Airflow's triggerer would apply it.

The events of asset-watcher and callback rows (``watchers``): ``Trigger.submit_event`` records
the asset events and queues the DAG runs they schedule (``AssetManager``), or moves the
callback on; re-implementing that would drift from Airflow too. Fenced by attempt, queue and
the row still being watched or called back.

Importing this module imports Airflow; its XCom pushes use Airflow's configured database
(``[database] sql_alchemy_conn``), as they do in Airflow's triggerer.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence

from airflow.models.trigger import Trigger
from airflow.sdk.serde import deserialize
from airflow.triggers.base import TaskFailedEvent, TriggerEvent
from sqlalchemy import Engine, TextClause, create_engine, text
from sqlalchemy.orm import Session

from triggerflow.airflow import persisted
from triggerflow.airflow.events import AirflowEvent
from triggerflow.airflow.nontask import NON_TASK
from triggerflow.airflow.schema import SCHEMA

# The batch's fence, for one event: lock triggerflow's row of the current attempt of a
# trigger of the event's queue whose task is still deferred on it.
FENCE = text(f"""
SELECT s.trigger_id FROM {SCHEMA}.trigger_state s
JOIN "trigger" t ON t.id = s.trigger_id AND coalesce(t.queue, :default_queue) = :queue
WHERE s.trigger_id = :trigger_id AND s.attempt = :attempt
  AND EXISTS (SELECT 1 FROM task_instance ti
              WHERE ti.trigger_id = s.trigger_id AND ti.state = 'deferred')
FOR UPDATE OF s
""")

CLEAN = text(f"""
WITH gone AS (
    DELETE FROM "trigger" t
    WHERE t.id = :trigger_id
      AND NOT EXISTS (SELECT 1 FROM task_instance ti WHERE ti.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM asset_watcher aw WHERE aw.trigger_id = t.id)
      AND NOT EXISTS (SELECT 1 FROM callback cb WHERE cb.trigger_id = t.id)
    RETURNING t.id
)
DELETE FROM {SCHEMA}.trigger_state s USING gone WHERE s.trigger_id = gone.id
""")


@functools.cache
def _engine(url: str) -> Engine:
    return create_engine(url, pool_size=1, max_overflow=1)


def sqlalchemy_url(dsn: str) -> str:
    return dsn.replace("postgresql://", "postgresql+psycopg2://", 1)


def _each_fenced(dsn: str, events: Sequence[AirflowEvent], fence: TextClause,
                 default_queue: str | None,
                 submit: Callable[[Session, AirflowEvent], None]) -> list[AirflowEvent]:
    """``submit`` each event that passes ``fence``, in a session of its own (as Airflow's
    triggerer handles each event), then ``CLEAN`` its row if nothing uses it any more.
    Blocking; returns the events submitted (the fenced-out are stale)."""
    done = []
    for event in events:
        # Session options as Airflow configures its own (airflow.settings): no autoflush.
        with Session(_engine(sqlalchemy_url(dsn)), autoflush=False,
                     expire_on_commit=False) as session, session.begin():
            fenced = session.execute(fence, {
                "trigger_id": event.trigger_id, "attempt": event.attempt, "queue": event.queue,
                "default_queue": default_queue}).first()
            if fenced is None:
                continue
            submit(session, event)
            session.flush()
            session.execute(CLEAN, {"trigger_id": event.trigger_id})
        done.append(event)
    return done


def _task_failed(session: Session, event: AirflowEvent) -> None:
    body = json.loads(event.body) or {}
    xcoms = deserialize(body.get("serde_xcoms"))
    Trigger.submit_event(event.trigger_id, TaskFailedEvent(xcoms=xcoms), session=session)


def apply_with_airflow(dsn: str, events: Sequence[AirflowEvent],
                       default_queue: str | None) -> list[AirflowEvent]:
    """Apply each event with ``Trigger.submit_event`` (blocking); returns those that moved."""
    return _each_fenced(dsn, events, FENCE, default_queue, _task_failed)


# The fence of an asset-watcher or callback event: triggerflow's row of the event's attempt,
# of a trigger of the event's queue that is still watched or called back. The row stays
# (CLEAN keeps it) unless this event was a callback's last: Callback.handle_event detaches it.
WATCHER_FENCE = text(f"""
SELECT s.trigger_id FROM {SCHEMA}.trigger_state s
JOIN "trigger" t ON t.id = s.trigger_id AND coalesce(t.queue, :default_queue) = :queue
WHERE s.trigger_id = :trigger_id AND s.attempt = :attempt AND {NON_TASK}
FOR UPDATE OF s
""")


# Delivered only if the event's transaction commits: what acks an ack-mode stream's message.
PERSISTED = text(f"SELECT pg_notify('{persisted.CHANNEL}', :notice)")


def _watched(session: Session, event: AirflowEvent) -> None:
    payload = deserialize(json.loads(event.body))
    Trigger.submit_event(event.trigger_id, TriggerEvent(payload),  # type: ignore[no-untyped-call]
                         session=session)
    session.execute(PERSISTED, {"notice": persisted.notice(event.trigger_id, event.body)})


def apply_watcher_events(dsn: str, events: Sequence[AirflowEvent],
                         default_queue: str | None) -> list[AirflowEvent]:
    """Each event of an asset-watcher or callback row through ``Trigger.submit_event``, as
    Airflow's triggerer handles each (``handle_events``): an asset event per watched asset
    (``AssetManager.register_asset_change``, which queues the DAG runs it schedules for the
    scheduler), or the callback's new state. Blocking; returns the events applied."""
    return _each_fenced(dsn, events, WATCHER_FENCE, default_queue, _watched)
