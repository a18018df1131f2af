"""A RabbitMQ queue as an asset watcher's source (``triggerflow/airflow/rabbitmq.py``): each
message one event, acked only once the writer's NOTIFY says its event is committed
(``triggerflow/airflow/persisted.py``), through Airflow 3.3's own ``SharedStreamManager`` in
ack mode, on the real broker and a real PostgreSQL. The writer's side (its NOTIFY in the
transaction that records the asset event) runs on the real stack in
``tests/test_airflow_assets.py``."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import asyncpg
import pytest

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from tests.airflow_support import airflow_3_3_only
from tests.conftest import Counted, wait_until
from triggerflow.model import EventKind
from triggerflow.runner import Held, TriggerRunner
from triggerflow.wire import encode_json

CONN_ID = "tf_source_broker"

pytestmark = airflow_3_3_only  # shared streams are Airflow 3.3's


@pytest.fixture
async def source(amqp_server: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """A fresh queue on the suite's broker, and an Airflow connection (environment) to it."""
    parts = urlsplit(amqp_server)
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}",
                       f"amqp://guest:guest@{parts.hostname}:{parts.port}/")
    name = f"tf-source-{uuid.uuid4().hex[:8]}"
    conn = await aio_pika.connect(amqp_server)
    channel = await conn.channel()
    await channel.declare_queue(name)
    try:
        yield name
    finally:
        await channel.queue_delete(name)
        await conn.close()


async def publish(amqp_server: str, queue: str, bodies: list[bytes]) -> None:
    conn = await aio_pika.connect(amqp_server)
    async with conn:
        channel = await conn.channel()
        for i, body in enumerate(bodies):
            await channel.default_exchange.publish(
                aio_pika.Message(body, message_id=f"m{i}", content_type="text/plain"), queue)


async def ready(amqp_server: str, queue: str) -> int:
    """Messages ready in ``queue`` (a passive declare: unacked ones are not counted)."""
    conn = await aio_pika.connect(amqp_server)
    async with conn:
        declared = await (await conn.channel()).declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def watch_queue(queue: str, dsn: str, confirm_writes: bool, amqp_server: str,
                      ) -> tuple[list[dict[str, Any]], int]:
    """Two messages read by one watcher under the consumer's ack-mode plumbing; with
    ``confirm_writes`` the writer's notifications are sent for both events (as its commit
    would), without, none. Returns the events' payloads and the messages ready once the
    watcher stopped (its channel closed: what was not acked is back in the queue)."""
    from triggerflow.airflow.persisted import CHANNEL, PENDING, notice
    from triggerflow.airflow.rabbitmq import RabbitMQQueueTrigger
    from triggerflow.airflow.watchers import WatcherCoroutine, shared_streams

    events: list[tuple[int, EventKind, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: events.append((held.id, kind, payload)))
    async with PENDING.serving(dsn, shared_streams().confirm_persisted):
        runner.start(Held(7, 1, "q", "c", None, None, None),
                     WatcherCoroutine(lambda: RabbitMQQueueTrigger(queue=queue, conn_id=CONN_ID)))
        await wait_until(lambda: asyncio.sleep(0, len(events) == 2), 20, interval=0.05,
                         message="both messages emitted as events")
        if confirm_writes:
            writer = await asyncpg.connect(dsn)
            try:
                for trigger_id, _, payload in events:
                    await writer.execute("SELECT pg_notify($1, $2)", CHANNEL,
                                         notice(trigger_id, encode_json(payload.value)))
            finally:
                await writer.close()
            group = next(iter(shared_streams()._groups.values()))
            await wait_until(lambda: asyncio.sleep(0, not group._outstanding), 20,
                             interval=0.05, message="both messages acked")
        else:
            await asyncio.sleep(1.0)  # a confirmation that would come, comes by now
        runner.cancel([7])
        await runner.wait_cleanups()
    await asyncio.sleep(0.5)  # the broker requeues what the closed channel held
    return [payload.value for _, _, payload in events], await ready(amqp_server, queue)


async def test_messages_stay_unacked_until_their_events_are_committed(
        source: str, amqp_server: str, dsn: str) -> None:
    await publish(amqp_server, source, [b"first", b"\xff\xfe"])
    # No writer confirmation: both events left the watcher, neither message was acked.
    payloads, left = await watch_queue(source, dsn, False, amqp_server)
    assert [(p["body"], p["encoding"], p["message_id"]) for p in payloads] == [
        ("first", "utf-8", "m0"), ("//4=", "base64", "m1")], payloads
    assert left == 2
    # Redelivered; this time the writer confirms both commits: acked, gone from the queue.
    payloads, left = await watch_queue(source, dsn, True, amqp_server)
    assert [p["message_id"] for p in payloads] == ["m0", "m1"]
    assert left == 0


def test_the_rabbitmq_trigger_is_an_ack_mode_shared_stream() -> None:
    from triggerflow.airflow.rabbitmq import CLASSPATH, RabbitMQQueueTrigger
    from triggerflow.airflow.watchers import ack_mode, shared_key

    trigger = RabbitMQQueueTrigger(queue="inbox", conn_id="broker")
    assert trigger.serialize() == (CLASSPATH, {"queue": "inbox", "conn_id": "broker",
                                               "prefetch": 100})
    assert shared_key(trigger) == ("rabbitmq", "broker", "inbox")
    assert ack_mode(RabbitMQQueueTrigger)


async def test_an_ack_mode_watcher_that_cannot_listen_is_started_again_not_failed(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """No LISTEN connection (here: no consumer database at all): the watcher does not start
    its stream, so no message can be taken that could never be acked; it is started again,
    as Airflow's triggerer restarts a failed watcher, and no failure event is emitted."""
    from triggerflow.airflow.rabbitmq import RabbitMQQueueTrigger
    from triggerflow.airflow.watchers import WatcherCoroutine

    events: list[tuple[int, EventKind]] = []
    built: list[int] = []
    counted = Counted()
    monkeypatch.setattr("triggerflow.airflow.watchers.get_metrics", lambda: counted)

    def build() -> Any:
        built.append(1)
        return RabbitMQQueueTrigger(queue="never-read", conn_id=CONN_ID)

    runner = TriggerRunner(lambda held, kind, payload: events.append((held.id, kind)))
    watcher = WatcherCoroutine(build, restart_delay=0.05)
    runner.start(Held(9, 1, "q", "c", None, None, None), watcher)
    await wait_until(lambda: asyncio.sleep(0, len(built) >= 3), 10, interval=0.02,
                     message="the watcher built again after each refusal")
    runner.cancel([9])
    await runner.wait_cleanups()
    assert events == []
    assert "cannot LISTEN for its events' commits" in caplog.text
    # ... and counted, for the dashboards and alerts (not only a log line)
    restarts = [labels for name, _, labels in counted.adds if name == "watcher_restarts"]
    assert restarts[:2] == [{"trigger_class": "RabbitMQQueueTrigger",
                             "reason": "listen_failed"}] * 2, counted.adds
