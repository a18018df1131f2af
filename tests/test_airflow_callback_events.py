"""A callback row's events on a real Airflow 3.3.2 schema: a ``CallbackTrigger`` yields
"running" then "success" in one attempt, and a writer that takes both in one batch (a busy
writer does: CI's deadline test, whose callback then stayed "running" for 300 s) applies both,
in order, with Airflow's ``Callback.handle_event``: the callback ends "success" with its
output, detached from its trigger row, which is deleted with triggerflow's bookkeeping."""

from __future__ import annotations

import json
import time

import asyncpg

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from triggerflow.airflow.store import AirflowStore
from triggerflow.store import ProcessKind
from triggerflow.wire import Event

__all__ = ["airflow_db", "airflow_template"]

CALLBACK_TRIGGER = "airflow.triggers.callback.CallbackTrigger"


async def add_callback(dsn: str) -> int:
    """A queued triggerer callback and its trigger row (no queue), as
    ``TriggererCallback.queue`` writes them; the trigger id."""
    from airflow.serialization.serialized_objects import BaseSerialization

    from triggerflow.airflow.kwargs import encrypt_kwargs

    conn = await asyncpg.connect(dsn)
    try:
        kwargs = encrypt_kwargs({"callback_path": "tests.airflow_triggers.deadline_missed",
                                 "callback_kwargs": {}})
        trigger_id: int = await conn.fetchval(
            """INSERT INTO "trigger" (classpath, kwargs, created_date) VALUES ($1, $2, now())
               RETURNING id""", CALLBACK_TRIGGER, kwargs)
        await conn.execute(
            """INSERT INTO callback (id, type, fetch_method, data, state, priority_weight,
                                     created_at, trigger_id)
               VALUES (gen_random_uuid(), 'triggerer', 'import_path', $1::json, 'queued', 1,
                       now(), $2)""",
            json.dumps(BaseSerialization.serialize(  # ExtendedJSON, as Airflow stores it
                {"path": "tests.airflow_triggers.deadline_missed", "kwargs": {}})),
            trigger_id)
        return trigger_id
    finally:
        await conn.close()


def callback_event(trigger_id: int, attempt: int, payload: dict[str, str]) -> Event:
    from airflow.triggers.base import TriggerEvent

    from triggerflow.airflow.codec import encode_event

    kind, body = encode_event(TriggerEvent(payload))
    return Event(trigger_id, attempt, "default", kind, body, time.time())


async def test_a_callbacks_running_and_success_in_one_batch_both_apply(airflow_db: str) -> None:
    from triggerflow.writer_lanes import batch

    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    trigger_id = await add_callback(dsn)
    store = await AirflowStore.connect(dsn, default_queue="default")
    try:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, ["default"], 10, "t", 30)
        [claimed] = (await store.claim(me, [trigger_id], ["default"])).claimed
        running = callback_event(trigger_id, claimed.attempt, {"state": "running"})
        success = callback_event(trigger_id, claimed.attempt,
                                 {"state": "success", "body": "deadline missed"})
        # As the writer takes them: one message, delivered twice.
        events = batch([running, success, running, success])
        assert events == [running, success]
        await store.apply_events(events)
        row = await af.scalar(dsn, "SELECT row(state, output, trigger_id)::text FROM callback")
        assert row == "(success,\"deadline missed\",)"
        await store.unused.flush()
        assert await af.scalar(dsn, 'SELECT count(*) FROM "trigger"') == 0
        assert await af.scalar(dsn, "SELECT count(*) FROM triggerflow.trigger_state") == 0
    finally:
        await store.close()
