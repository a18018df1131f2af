"""A RabbitMQ queue as the event source of an Airflow asset watcher.

``RabbitMQQueueTrigger(queue=..., conn_id=...)`` in an ``AssetWatcher``: each message of the
queue becomes one asset event (``extra["payload"]``: its body, message id, routing key,
content type and headers), and the message is acked only once that asset event is committed
to Airflow's database. It is an Airflow 3.3 shared stream in ack mode
(``create_shared_stream_producer``), so it runs the same under ``airflow triggerer`` and
under triggerflow (``persisted`` confirms the commit there): one broker consumer per queue
and triggerer process, however many watchers read the queue; a message is acked only when
every watcher that was reading it has its event committed.

The broker is an Airflow connection (``conn_id``, type ``amqp``; host, port, login,
password, schema = virtual host; ``extra`` ``{"ssl": true}`` for amqps), read through
Airflow's secrets backends as any trigger reads one. Messages are taken ``prefetch`` at a
time. A message whose event could not be committed within ``[triggerer]
shared_stream_ack_timeout`` goes back to the queue (``nack`` with requeue) and comes again: at
least once, so a DAG that cares deduplicates on ``message_id``. A watcher that refuses a
message (``reject_shared_stream_event``) has it rejected without requeue: dead-lettered if
the queue has a dead-letter exchange, dropped otherwise.

Importing this module imports Airflow and aio-pika.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Hashable, Sequence
from typing import Any
from urllib.parse import quote

import aio_pika
from airflow.triggers.base import BaseEventTrigger, TriggerEvent
from airflow.triggers.shared_stream import AdvanceItem, SharedStreamProducer

CLASSPATH = "triggerflow.airflow.rabbitmq.RabbitMQQueueTrigger"


def message_event(message: aio_pika.abc.AbstractIncomingMessage) -> dict[str, Any]:
    """What an asset event records of a message (JSON: Airflow stores it in ``extra``)."""
    try:
        body: str = message.body.decode()
        encoding = "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(message.body).decode(), "base64"
    headers = {str(k): v if isinstance(v, (str, int, float, bool)) or v is None else str(v)
               for k, v in (message.headers or {}).items()}
    return {"body": body, "encoding": encoding, "message_id": message.message_id,
            "routing_key": message.routing_key, "content_type": message.content_type,
            "headers": headers}


async def broker_url(conn_id: str) -> str:
    """The AMQP URL of an Airflow connection, read as trigger code reads one."""
    from airflow.sdk import BaseHook

    conn = await BaseHook.aget_connection(conn_id)
    extra = conn.extra_dejson or {}
    scheme = "amqps" if extra.get("ssl") else "amqp"
    auth = f"{quote(conn.login or 'guest', safe='')}:{quote(conn.password or 'guest', safe='')}"
    vhost = quote(conn.schema or "/", safe="")
    return f"{scheme}://{auth}@{conn.host or 'localhost'}:{conn.port or 5672}/{vhost}"


class QueueProducer(SharedStreamProducer):
    """The broker side of one queue's stream: consumes it, acks what was committed."""

    def __init__(self, conn_id: str, queue: str, prefetch: int) -> None:
        self.conn_id, self.queue, self.prefetch = conn_id, queue, prefetch
        self.connection: aio_pika.abc.AbstractConnection | None = None

    async def open_stream(self) -> AsyncIterator[tuple[Any, Any]]:
        self.connection = await aio_pika.connect(await broker_url(self.conn_id))
        channel = await self.connection.channel()
        await channel.set_qos(prefetch_count=self.prefetch)
        queue = await channel.get_queue(self.queue, ensure=True)  # absent: raises, retried
        async with queue.iterator() as messages:
            async for message in messages:
                yield message_event(message), message
        raise ConnectionError(f"RabbitMQ stopped delivering from queue {self.queue!r}")

    async def advance(self, batch: Sequence[AdvanceItem]) -> None:
        for item in batch:
            message: aio_pika.abc.AbstractIncomingMessage = item.broker_payload
            if item.outcome.is_clean:
                await message.ack()
            elif item.outcome.rejected:
                await message.reject(requeue=False)
            else:  # not committed in time, or read by no watcher: again later
                await message.nack(requeue=True)

    async def aclose(self) -> None:
        if self.connection is not None:
            await self.connection.close()


class RabbitMQQueueTrigger(BaseEventTrigger):
    """Each message of ``queue`` on the broker of ``conn_id``: one asset event."""

    def __init__(self, queue: str, conn_id: str = "rabbitmq_default", prefetch: int = 100,
                 ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.queue, self.conn_id, self.prefetch = queue, conn_id, prefetch

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"queue": self.queue, "conn_id": self.conn_id,
                           "prefetch": self.prefetch}

    def shared_stream_key(self) -> Hashable:
        return ("rabbitmq", self.conn_id, self.queue)

    @classmethod
    def create_shared_stream_producer(cls, kwargs: dict[str, Any]) -> SharedStreamProducer:
        return QueueProducer(kwargs["conn_id"], kwargs["queue"], int(kwargs.get("prefetch", 100)))

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]
                                   ) -> AsyncIterator[TriggerEvent]:
        async for message in shared_stream:
            yield TriggerEvent(message)  # type: ignore[no-untyped-call]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # Airflow 3.3's triggerer and triggerflow both read it as a shared stream.
        raise RuntimeError(f"{CLASSPATH} runs only as an ack-mode shared stream (Airflow 3.3)")
        yield  # pragma: no cover - makes this an async generator
