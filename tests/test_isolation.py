"""Isolation between teams on the real services: an event is applied only for a trigger of
the queue its routing key names, only with a kind the project defines; control messages
cancel only what the store confirms; refused deferrals leak nothing."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tests.conftest import Processes, wait_until
from tests.test_bad_input import dead_letters, insert_trigger
from tests.triggers import EventAfter
from triggerflow.model import TaskKey
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers.file import FileTrigger
from triggerflow.wire import Event, encode_events


async def publish_raw(settings: Settings, routing_key: str, events: list[Event] | bytes) -> None:
    """Publish events as any team's user could, straight to the events exchange."""
    body = events if isinstance(events, bytes) else encode_events(events)
    broker = RabbitTransport(settings.amqp_dsn(), Topology(settings.namespace))
    await broker.connect()
    try:
        await broker.publish(broker.topology.events, routing_key, body, user_id="guest")
    finally:
        await broker.close()


async def test_event_naming_another_teams_trigger_is_dead_lettered_by_default(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    """No team_users: team A's routing key cannot carry an event for team B's trigger."""
    procs.writer()
    victim = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    forged = Event(victim, 0, teams[1], "success", json.dumps({"forged": True}), time.time())
    await publish_raw(settings, teams[0], [forged])
    letters = await dead_letters(settings, 1)
    assert letters and "routing key" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_queue_missing_from_team_users_is_still_checked_against_the_routing_key(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    procs.writer(team_users={teams[0]: "guest"})
    victim = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[1], 1)
    forged = Event(victim, 0, teams[1], "success", "1", time.time())
    await publish_raw(settings, teams[0], [forged])
    letters = await dead_letters(settings, 1)
    assert letters and "routing key" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_unknown_event_kind_is_dead_lettered_and_never_becomes_a_state(
    db: Database, procs: Processes, teams: list[str], settings: Settings,
) -> None:
    procs.writer()
    tid = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    body = json.dumps({"v": 2, "events": [[tid, 0, teams[0], "pwned", "1", time.time()]]})
    await publish_raw(settings, teams[0], body.encode())
    letters = await dead_letters(settings, 1)
    assert letters and "unknown event kind 'pwned'" in letters[0][1]
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"


async def test_store_ignores_an_unknown_kind_even_when_asked_directly(
    db: Database, teams: list[str], dsn: str,
) -> None:
    from triggerflow.store.postgres.store import PostgresStore

    tid = await insert_trigger(db, "tests.triggers.EventAfter", "{}", teams[0], 1)
    store = await PostgresStore.connect(dsn)
    try:
        ev = Event(tid, 0, teams[0], "resume", "1", time.time())
        ev.kind = "pwned"  # past the wire's check, as a buggy caller of the store could
        applied = await store.apply_events([ev])
    finally:
        await store.close()
    assert applied == []
    assert await db.fetchval("SELECT state FROM task_instance") == "deferred"
    assert await db.fetchval("SELECT count(*) FROM trigger") == 1


async def test_non_utf8_file_name_ends_the_task_with_a_readable_failure(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    tmp_path: Path,
) -> None:
    """glob returns the name with lone surrogates; the payload check turns it into __fail__."""
    (tmp_path / os.fsdecode(b"report-\xff.csv")).write_text("x")
    procs.writer()
    procs.consume(teams[0])
    await client.defer(TaskKey("files", "t", "r"),
                       FileTrigger(str(tmp_path / "*.csv"), poke_interval=0.1), queue=teams[0])
    await client.defer(TaskKey("files", "after", "r"), EventAfter(payload="still-serving"),
                       queue=teams[0])
    row = await wait_until(lambda: db.fetchrow(
        "SELECT next_method, next_kwargs->>'message' AS message FROM task_instance "
        "WHERE task_id = 't' "
        "AND state = 'scheduled'"), 15)
    assert row["next_method"] == "__fail__"
    message = row["message"]
    assert "FileTrigger" in message and "not valid UTF-8" in message
    await wait_until(lambda: db.fetchval(
        "SELECT next_kwargs->>'event' = 'still-serving' FROM task_instance "
        "WHERE task_id = 'after'"), 15)
