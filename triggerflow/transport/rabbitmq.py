"""RabbitMQ adapter of :class:`~triggerflow.transport.Transport`: declarations, confirmed
publishes, subscriptions whose loss can be seen.

Names are derived from one namespace in one place (``Topology``) and mirrored in
``brokers/rabbitmq/definitions.json``; a test keeps the two in step, since RabbitMQ refuses
a re-declare with other arguments. The connection is not "robust": each component runs its
own reconnect loop and re-subscribes explicitly (``transport.subscriptions``), because
aio-pika's automatic restore has lost consumers before (aio-pika #231, #334, #536). aio-pika's
errors do not leave this module: they become the transport's own. Imports nothing from the
database side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)
from yarl import URL

from triggerflow.transport.interface import (
    AccessRefused,
    DeliveryHandler,
    PublishRefused,
    QueueInfo,
    TransportUnavailable,
    Unroutable,
)
from triggerflow.wire import (
    HEADER_REASON,
    HEADER_TRACEPARENT,
    Event,
    encode_control,
    encode_events,
    encode_wakeup,
)

log = logging.getLogger(__name__)

# Errors after which the connection (or channel) is gone and must be rebuilt.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    aio_pika.exceptions.AMQPConnectionError,
    aio_pika.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.ConnectionClosed,
    ConnectionError,
    OSError,
)


# The broker refused who we are: a wrong password or unknown user (RabbitMQ closes the
# connection during the handshake) or a virtual host this user may not open.
ACCESS_ERRORS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ConnectionNotAllowed,
)


@contextlib.asynccontextmanager
async def _connection_errors() -> AsyncIterator[None]:
    try:
        yield
    except ACCESS_ERRORS as exc:
        raise AccessRefused(f"{type(exc).__name__}: {exc}") from exc
    except CONNECTION_ERRORS as exc:
        raise TransportUnavailable(repr(exc)) from exc


class AmqpDelivery:
    """A received AMQP message as a :class:`~triggerflow.transport.Delivery`."""

    __slots__ = ("_message",)

    def __init__(self, message: AbstractIncomingMessage) -> None:
        self._message = message

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def routing_key(self) -> str:
        return self._message.routing_key or ""

    @property
    def user_id(self) -> str | None:
        return self._message.user_id

    async def ack(self, *, multiple: bool = False) -> None:
        async with _connection_errors():
            await self._message.ack(multiple=multiple)

    async def reject(self, *, requeue: bool = False) -> None:
        async with _connection_errors():
            await self._message.reject(requeue=requeue)


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


class RabbitTransport:
    """One AMQP connection and one confirming channel: the Transport on RabbitMQ."""

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
        self.user = URL(url).user or "guest"

    async def connect(self) -> None:
        if self.connection is not None and not self.connection.is_closed:
            # Reconnecting after the broker closed only our channel (a refused publish):
            # the old connection would stay open on the broker otherwise.
            await self.close()
        self.closed.clear()
        async with _connection_errors():
            try:
                self.connection = await aio_pika.connect(
                    self.url, client_properties={"connection_name": self.name}
                )
            except aiormq.exceptions.InvalidFrameError as exc:
                # RabbitMQ answers Connection.Open with Connection.Close (530 NOT_ALLOWED) for
                # a vhost this user may not open or that does not exist; aiormq reports only
                # the unexpected frame.
                if "Connection.Close" not in str(exc):
                    raise
                raise AccessRefused(f"the broker refused to open virtual host "
                                    f"{URL(self.url).path[1:] or '/'!r} for user "
                                    f"{self.user!r}") from exc
            self.connection.close_callbacks.add(lambda *_: self.closed.set())
            self.channel = await self.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
        self.channel.close_callbacks.add(lambda *_: self.closed.set())
        self._exchanges = {}

    async def wait_closed(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # not wait_for: see consumer.lease
                await self.closed.wait()
        return self.closed.is_set()

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
            raise TransportUnavailable("not connected")
        return self.channel

    # -- topology ------------------------------------------------------------------------

    async def declare(self, team_queues: Sequence[str], *, delivery_limit: int = 5) -> None:
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

    async def queue_info(self, name: str) -> QueueInfo | None:
        """Messages ready and consumers of a queue, or None when it does not exist.

        Uses a throwaway channel: a passive declare of a missing queue closes its channel.
        """
        if self.connection is None:
            raise TransportUnavailable("not connected")
        async with _connection_errors():
            ch = await self.connection.channel(publisher_confirms=False)
            try:
                q = await ch.declare_queue(name, passive=True)
                result = q.declaration_result
                return QueueInfo(int(result.message_count or 0), int(result.consumer_count or 0))
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
        """Publish and wait for the broker's confirm; raise Unroutable if returned."""
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
            async with _connection_errors():
                await ex.publish(message, routing_key=routing_key, mandatory=mandatory)
        except aio_pika.exceptions.PublishError as exc:
            raise Unroutable(
                f"{exchange!r} could not route key {routing_key!r}: no queue is bound to it"
            ) from exc
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise PublishRefused(
                f"broker refused publishing to {exchange!r} with key {routing_key!r}: {exc}"
            ) from exc

    # -- consuming -----------------------------------------------------------------------

    async def _consume(self, queue: str, handler: DeliveryHandler, prefetch: int,
                       **declare: Any) -> tuple[Any, str]:
        async def deliver(message: AbstractIncomingMessage) -> None:
            await handler(AmqpDelivery(message))

        async with _connection_errors():
            ch = self._channel()
            await ch.set_qos(prefetch_count=prefetch)
            # Without declare arguments the queue must exist (passive): a typo never creates
            # a queue nobody publishes to.
            q = await ch.declare_queue(queue, **(declare or {"passive": True}))
            return q, await q.consume(deliver)

    async def subscribe(self, queue: str, handler: DeliveryHandler, *, prefetch: int) -> str:
        return (await self._consume(queue, handler, prefetch))[1]

    async def subscribe_events(self, handler: DeliveryHandler, *, prefetch: int) -> str:
        return await self.subscribe(self.topology.events_queue, handler, prefetch=prefetch)

    async def subscribe_control(self, consumer_id: int, handler: DeliveryHandler, *,
                                prefetch: int) -> str:
        # Server-named ("amq.gen-…"): no client may declare a name under "amq.", so no team
        # can take a consumer's control queue before it exists.
        q, tag = await self._consume("", handler, prefetch, exclusive=True, auto_delete=True)
        async with _connection_errors():
            await q.bind(self.topology.control, str(consumer_id))
        return tag

    async def unsubscribe(self, tag: str) -> None:
        async with _connection_errors():
            underlay = await self._channel().get_underlay_channel()
            await underlay.basic_cancel(tag)

    async def is_consuming(self, tag: str) -> bool:
        """False once the broker cancelled our consumer (queue deleted, failover...)."""
        if not self.is_open:
            return False
        async with _connection_errors():
            underlay: Any = await self._channel().get_underlay_channel()  # aiormq.Channel
        return tag in underlay.consumers

    # -- what the loops publish --------------------------------------------------------

    async def publish_wakeups(
        self, ids_by_queue: Mapping[str, Sequence[int]], *, chunk: int = 1000,
        rate: float | None = None, traceparent: str | None = None,
    ) -> None:
        """Publish wake-ups, ``chunk`` ids a message, at most ``rate`` ids a second.

        Chunking keeps each claim a bounded statement; the rate bound keeps a 100k reclaim
        from flooding peers so they starve their own renewals.
        """
        headers = {HEADER_TRACEPARENT: traceparent} if traceparent else None
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), 0
        for queue, ids in ids_by_queue.items():
            for i in range(0, len(ids), chunk):
                part = list(ids[i : i + chunk])
                await self.publish(self.topology.deferrals, queue, encode_wakeup(part),
                                   headers=headers)
                sent += len(part)
                if rate:
                    ahead = sent / rate - (loop.time() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)

    async def publish_events(self, queue: str, events: Sequence[Event]) -> None:
        await self.publish(self.topology.events, queue, encode_events(list(events)),
                           user_id=self.user)

    async def publish_control(self, consumer_id: int, op: str, ids: Sequence[int]) -> None:
        await self.publish(self.topology.control, str(consumer_id),
                           encode_control(op, list(ids)), mandatory=False)

    async def dead_letter(self, body: bytes, reason: str, *, source: str) -> None:
        """Park an unusable message on the dead-letter exchange with a readable reason."""
        await self.publish(self.topology.dead, source, body,
                           headers={HEADER_REASON: reason[:1000]}, mandatory=False)
