"""RabbitMQ adapter: topology names, declarations, confirmed publishes, watched subscriptions.

Names are derived from one namespace in one place (``Topology``) and mirrored in
``brokers/rabbitmq/definitions.json``; a test keeps the two in step, since RabbitMQ refuses
a re-declare with other arguments. The connection is not "robust": each component runs its
own reconnect loop and re-subscribes explicitly, because aio-pika's automatic restore has
lost consumers before (aio-pika #231, #334, #536). Imports nothing from the database side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
    AbstractQueue,
)

log = logging.getLogger(__name__)

DeliveryHandler = Callable[[AbstractIncomingMessage], Awaitable[None]]

# Errors after which the connection (or channel) is gone and must be rebuilt.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    aio_pika.exceptions.AMQPConnectionError,
    aio_pika.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
    ConnectionError,
    OSError,
)


class UnroutableError(RuntimeError):
    """The broker could not route a mandatory publish: no queue is bound for its key."""


class RefusedError(RuntimeError):
    """The broker refused a publish for this user (topic or write permission)."""


@dataclass(frozen=True)
class Topology:
    """Every exchange and shared-queue name, derived from one namespace."""

    namespace: str = "triggerflow"

    @property
    def deferrals(self) -> str:
        return f"{self.namespace}.deferrals"

    @property
    def events(self) -> str:
        return f"{self.namespace}.events"

    @property
    def events_queue(self) -> str:
        return f"{self.namespace}.events"

    @property
    def dead(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def dead_queue(self) -> str:
        return f"{self.namespace}.dead"

    @property
    def control(self) -> str:
        return f"{self.namespace}.control"

    def control_queue(self, consumer_id: int) -> str:
        return f"{self.namespace}.control.{consumer_id}"

    def exchanges(self) -> dict[str, str]:
        return {
            self.deferrals: "topic",
            self.events: "topic",
            self.dead: "topic",
            self.control: "direct",
        }

    def queue_arguments(self, delivery_limit: int = 5) -> dict[str, Any]:
        """Arguments of team queues and the events queue (quorum, DLX, explicit limit)."""
        return {
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": self.dead,
            "x-delivery-limit": delivery_limit,
        }


class Broker:
    """One AMQP connection and one confirming channel, with the few operations we need."""

    def __init__(self, url: str, topology: Topology, *, name: str = "triggerflow") -> None:
        self.url = url
        self.topology = topology
        self.name = name
        self.connection: AbstractConnection | None = None
        self.channel: AbstractChannel | None = None
        self._exchanges: dict[str, AbstractExchange] = {}
        self.closed = asyncio.Event()
        # The AMQP user, stamped as ``user_id`` on events: RabbitMQ rejects a user_id that is
        # not the connection's, so the writer can trust it to name the publishing team.
        self.user = unquote(urlsplit(url).username or "guest")

    async def connect(self) -> None:
        self.closed.clear()
        self.connection = await aio_pika.connect(
            self.url, client_properties={"connection_name": self.name}
        )
        self.connection.close_callbacks.add(lambda *_: self.closed.set())
        self.channel = await self.connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        self.channel.close_callbacks.add(lambda *_: self.closed.set())
        self._exchanges = {}

    async def close(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            with contextlib.suppress(TimeoutError, *CONNECTION_ERRORS):
                await asyncio.wait_for(self.connection.close(), timeout=5)
        self.closed.set()

    @property
    def is_open(self) -> bool:
        return (
            self.connection is not None
            and not self.connection.is_closed
            and self.channel is not None
            and not self.channel.is_closed
        )

    def _channel(self) -> AbstractChannel:
        if self.channel is None or self.channel.is_closed:
            raise aio_pika.exceptions.ChannelInvalidStateError("not connected")
        return self.channel

    # -- topology ------------------------------------------------------------------------

    async def declare(self, team_queues: list[str], *, delivery_limit: int = 5) -> None:
        """Idempotently declare exchanges, team queues, the events queue and dead letters."""
        ch = self._channel()
        t = self.topology
        for name, kind in t.exchanges().items():
            self._exchanges[name] = await ch.declare_exchange(
                name, aio_pika.ExchangeType(kind), durable=True
            )
        dead_q = await ch.declare_queue(t.dead_queue, durable=True)
        await dead_q.bind(t.dead, "#")
        args = t.queue_arguments(delivery_limit)
        events_q = await ch.declare_queue(t.events_queue, durable=True, arguments=args)
        await events_q.bind(t.events, "#")
        for team in team_queues:
            q = await ch.declare_queue(team, durable=True, arguments=args)
            await q.bind(t.deferrals, team)

    async def exchange(self, name: str) -> AbstractExchange:
        ex = self._exchanges.get(name)
        if ex is None:
            ex = await self._channel().get_exchange(name, ensure=False)
            self._exchanges[name] = ex
        return ex

    async def queue_info(self, name: str) -> tuple[int, int] | None:
        """(messages ready, consumers) of a queue, or None when it does not exist.

        Uses a throwaway channel: a passive declare of a missing queue closes its channel.
        """
        if self.connection is None:
            raise aio_pika.exceptions.ChannelInvalidStateError("not connected")
        ch = await self.connection.channel(publisher_confirms=False)
        try:
            q = await ch.declare_queue(name, passive=True)
            result = q.declaration_result
            return int(result.message_count or 0), int(result.consumer_count or 0)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        finally:
            if not ch.is_closed:
                await ch.close()

    # -- publishing ----------------------------------------------------------------------

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        headers: dict[str, Any] | None = None,
        mandatory: bool = True,
        persistent: bool = True,
        user_id: str | None = None,
    ) -> None:
        """Publish and wait for the broker's confirm; raise UnroutableError if returned."""
        ex = await self.exchange(exchange)
        message = aio_pika.Message(
            body,
            content_type="application/json",
            headers=headers or {},
            delivery_mode=(
                aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
            ),
            user_id=user_id,
        )
        try:
            await ex.publish(message, routing_key=routing_key, mandatory=mandatory)
        except aio_pika.exceptions.PublishError as exc:
            raise UnroutableError(
                f"{exchange!r} could not route key {routing_key!r}: no queue is bound to it"
            ) from exc
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise RefusedError(
                f"broker refused publishing to {exchange!r} with key {routing_key!r}: {exc}"
            ) from exc

    # -- consuming -----------------------------------------------------------------------

    async def subscribe(
        self,
        queue: str,
        handler: DeliveryHandler,
        *,
        prefetch: int,
        declare: dict[str, Any] | None = None,
    ) -> tuple[AbstractQueue, str]:
        """Start consuming ``queue``; returns the queue and the consumer tag.

        ``declare`` (keyword arguments of ``declare_queue``) declares the queue first; without
        it the queue must exist (passive), so a typo never creates a queue nobody publishes to.
        """
        ch = self._channel()
        await ch.set_qos(prefetch_count=prefetch)
        if declare is not None:
            q = await ch.declare_queue(queue, **declare)
        else:
            q = await ch.declare_queue(queue, passive=True)
        tag = await q.consume(handler)
        return q, tag

    async def is_consuming(self, tag: str) -> bool:
        """False once the broker cancelled our consumer (queue deleted, failover...)."""
        if not self.is_open:
            return False
        underlay: Any = await self._channel().get_underlay_channel()  # aiormq.Channel
        return tag in underlay.consumers

    async def publish_wakeups(
        self, ids_by_queue: dict[str, list[int]], *, chunk: int = 1000, rate: float | None = None,
        traceparent: str | None = None,
    ) -> None:
        """Publish wake-ups, ``chunk`` ids a message, at most ``rate`` ids a second.

        Chunking keeps each claim a bounded statement; the rate bound keeps a 100k reclaim
        from flooding peers so they starve their own renewals.
        """
        from triggerflow.wire import HEADER_TRACEPARENT, encode_wakeup

        headers = {HEADER_TRACEPARENT: traceparent} if traceparent else None
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), 0
        for queue, ids in ids_by_queue.items():
            for i in range(0, len(ids), chunk):
                part = ids[i : i + chunk]
                await self.publish(self.topology.deferrals, queue, encode_wakeup(part),
                                   headers=headers)
                sent += len(part)
                if rate:
                    ahead = sent / rate - (loop.time() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)

    async def dead_letter(self, body: bytes, reason: str, *, source: str) -> None:
        """Park an unusable message on the dead-letter exchange with a readable reason."""
        from triggerflow.wire import HEADER_REASON

        await self.publish(self.topology.dead, source, body,
                           headers={HEADER_REASON: reason[:1000]}, mandatory=False)
