"""RabbitMQ adapter of :class:`~triggerflow.transport.Transport`: declarations, confirmed
publishes, subscriptions whose loss can be seen.

Names come from :class:`~triggerflow.transport.topology.Topology` (each team queue has its own
deferral and control exchanges, so no header routes into another team's queue). The
connection is not "robust": each component runs its own reconnect loop and re-subscribes
explicitly (``transport.subscriptions``), because aio-pika's automatic restore has lost
consumers before (aio-pika #231, #334, #536). aio-pika's errors do not leave this module:
they become the transport's own. Imports nothing from the database side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
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
    QueueFull,
    QueueInfo,
    SubscribeRefused,
    TransportUnavailable,
    Unroutable,
)
from triggerflow.transport.management import ManagementClient, vhost_of
from triggerflow.transport.presence import relay_deleted_queues, watch_presence
from triggerflow.transport.topology import Topology
from triggerflow.wire import (
    HEADER_REASON,
    HEADER_TRACEPARENT,
    HEADER_TRUNCATED,
    MAX_IDS,
    MAX_MESSAGE_BYTES,
    Event,
    encode_control,
    encode_events,
    encode_wakeup,
)

__all__ = ["RabbitTransport", "Topology"]

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


class RabbitTransport:
    """One AMQP connection and one confirming channel: the Transport on RabbitMQ."""

    def __init__(self, url: str, topology: Topology, *, name: str = "triggerflow",
                 management_url: str | None = None) -> None:
        self.url = url
        # Where ``declare`` sets the queue-limit policies (AMQP cannot); None: not set.
        self.management_url = management_url
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
        """Idempotently declare exchanges, team queues, the events queue and dead letters;
        with a management URL, also the length-limit policies of the team and dead queues.

        This is also the migration from the shared deferral and control exchanges of older
        versions: each queue gets its own exchanges; the old ones keep their bindings so
        that clients not yet upgraded still deliver (docs/security.md, "Migrating")."""
        ch = self._channel()
        t = self.topology
        exchanges = dict(t.exchanges())
        for team in team_queues:
            exchanges.update(t.team_exchanges(team))
        for name, kind in exchanges.items():
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
            await q.bind(t.deferrals_of(team), team)
        assert self.connection is not None
        await relay_deleted_queues(self.connection, t)
        if self.management_url is None:
            log.warning("queue length limits not set (they need the management API: set "
                        "TRIGGERFLOW_MANAGEMENT_URL, or load the policies of "
                        "brokers/rabbitmq/definitions.json)")
            return
        vhost = vhost_of(self.url)
        async with ManagementClient(self.management_url) as api:
            for name, body in [t.dead_policy(), *map(t.limits_policy, team_queues)]:
                await api.set_policy(vhost, name, body)

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
        """Publish and wait for the broker's confirm; raise Unroutable if returned (or the
        exchange is missing), QueueFull if nacked, PublishRefused if forbidden or too big."""
        if len(body) > MAX_MESSAGE_BYTES:
            raise PublishRefused(f"message of {len(body)} bytes to {exchange!r} is over the "
                                 f"{MAX_MESSAGE_BYTES}-byte bound")
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
        except aio_pika.exceptions.DeliveryError as exc:
            raise QueueFull(
                f"broker refused a message to {exchange!r} with key {routing_key!r}: "
                "the queue is at its length limit") from exc
        except aiormq.exceptions.ChannelNotFoundEntity as exc:
            self._exchanges.pop(exchange, None)
            raise Unroutable(f"no exchange {exchange!r} (is `triggerflow topology apply` run "
                             f"for queue {routing_key!r}?): {exc}") from exc
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise PublishRefused(
                f"broker refused publishing to {exchange!r} with key {routing_key!r}: {exc}"
            ) from exc

    # -- consuming -----------------------------------------------------------------------

    async def _consume(self, queue: str, handler: DeliveryHandler, prefetch: int,
                       **declare: Any) -> tuple[Any, str]:
        async def deliver(message: AbstractIncomingMessage) -> None:
            await handler(AmqpDelivery(message))

        async with self._read_refusals(f"queue {queue!r}" if queue else "a control queue"), \
                _connection_errors():
            ch = self._channel()
            await ch.set_qos(prefetch_count=prefetch)
            # Without declare arguments the queue must exist (passive): a typo never creates
            # a queue nobody publishes to.
            q = await ch.declare_queue(queue, **(declare or {"passive": True}))
            return q, await q.consume(deliver)

    @contextlib.asynccontextmanager
    async def _read_refusals(self, what: str) -> AsyncIterator[None]:
        """ACCESS_REFUSED on a subscription is permanent: say which user and queue."""
        try:
            yield
        except aiormq.exceptions.ChannelAccessRefused as exc:
            raise SubscribeRefused(
                f"broker user {self.user!r} may not read {what}: {exc}") from exc

    async def subscribe(self, queue: str, handler: DeliveryHandler, *, prefetch: int) -> str:
        return (await self._consume(queue, handler, prefetch))[1]

    async def subscribe_events(self, handler: DeliveryHandler, *, prefetch: int) -> str:
        return await self.subscribe(self.topology.events_queue, handler, prefetch=prefetch)

    async def subscribe_control(self, consumer_id: int, handler: DeliveryHandler, *,
                                prefetch: int, queues: Sequence[str]) -> str:
        # Server-named ("amq.gen-…"): no client may declare a name under "amq.", so no team
        # can take a consumer's control queue before it exists. Bound to the control
        # exchange of each queue served: binding needs read on the exchange, which a team
        # user has for its own queues' only.
        q, tag = await self._consume("", handler, prefetch, exclusive=True, auto_delete=True)
        for queue in queues:
            exchange = self.topology.control_of(queue)
            async with self._read_refusals(f"control exchange {exchange!r}"), \
                    _connection_errors():
                await q.bind(exchange, str(consumer_id))
        return tag

    async def watch_presence(self, on_gone: Callable[[str], None]) -> str | None:
        if self.connection is None:
            raise TransportUnavailable("not connected")
        async with _connection_errors():
            return await watch_presence(self.connection, self.topology, vhost_of(self.url),
                                        on_gone)

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
        chunk = min(chunk, MAX_IDS)  # readers refuse bigger wake-ups
        for queue, ids in ids_by_queue.items():
            for i in range(0, len(ids), chunk):
                part = list(ids[i : i + chunk])
                await self.publish(self.topology.deferrals_of(queue), queue, encode_wakeup(part),
                                   headers=headers)
                sent += len(part)
                if rate:
                    ahead = sent / rate - (loop.time() - started)
                    if ahead > 0:
                        await asyncio.sleep(ahead)

    async def publish_events(self, queue: str, events: Sequence[Event]) -> None:
        """One message, or as many as keep each under the broker's message size bound."""
        body = encode_events(list(events))
        if len(body) > MAX_MESSAGE_BYTES and len(events) > 1:
            half = len(events) // 2
            await self.publish_events(queue, events[:half])
            await self.publish_events(queue, events[half:])
            return
        await self.publish(self.topology.events, queue, body, user_id=self.user)

    async def publish_control(self, consumer_id: int, op: str, ids: Sequence[int], *,
                              queue: str) -> None:
        for i in range(0, len(ids), MAX_IDS):
            await self.publish(self.topology.control_of(queue), str(consumer_id),
                               encode_control(op, list(ids[i : i + MAX_IDS])), mandatory=False)

    async def dead_letter(self, body: bytes, reason: str, *, source: str) -> None:
        """Park an unusable message on the dead-letter exchange with a readable reason,
        under ``source`` (topic permissions pin a team user to its own queue's name) and
        stamped with our user (RabbitMQ refuses a ``user_id`` that is not the
        connection's), so no team can file a dead letter in another team's name."""
        headers: dict[str, Any] = {HEADER_REASON: reason[:1000]}
        if len(body) > MAX_MESSAGE_BYTES:  # only from a broker with a larger max_message_size
            headers[HEADER_TRUNCATED] = len(body)
            body = body[:MAX_MESSAGE_BYTES]
        await self.publish(self.topology.dead, source, body, headers=headers, mandatory=False,
                           user_id=self.user)
