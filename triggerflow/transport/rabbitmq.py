"""RabbitMQ adapter of :class:`~triggerflow.transport.Transport`: declarations, confirmed
publishes, subscriptions whose loss can be seen.

Names come from :class:`~triggerflow.transport.topology.Topology` (each team queue has its own
deferral and control exchanges, so no header routes into another team's queue). The
connection is not "robust": each component runs its own reconnect loop and re-subscribes
explicitly (``transport.subscriptions``), because aio-pika's automatic restore has lost
consumers before (aio-pika #231, #334, #536). aio-pika's errors do not leave the adapter:
``transport.amqp`` maps them to the transport's own. ``transport.declare`` declares the
topology. Imports nothing from the database side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
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

from triggerflow.transport.amqp import (
    CONNECTION_ERRORS,
    AmqpDelivery,
    connection_errors,
    read_refusals,
)
from triggerflow.transport.declare import declare
from triggerflow.transport.interface import (
    AccessRefused,
    DeliveryHandler,
    PublishRefused,
    QueueFull,
    QueueInfo,
    TransportUnavailable,
    Unroutable,
)
from triggerflow.transport.management import vhost_of
from triggerflow.transport.presence import watch_presence
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
        async with connection_errors():
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
            async with asyncio.timeout(timeout):  # not wait_for: see triggerflow.lease
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
        with a management URL, also the length-limit policies (``transport.declare``)."""
        ch = self._channel()
        assert self.connection is not None
        self._exchanges.update(await declare(
            ch, self.connection, self.topology, team_queues,
            delivery_limit=delivery_limit, management_url=self.management_url, url=self.url))

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
        async with connection_errors():
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
            async with connection_errors():
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

        async with read_refusals(self.user, f"queue {queue!r}" if queue else "a control queue"), \
                connection_errors():
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
                                prefetch: int, queues: Sequence[str]) -> str:
        # Server-named ("amq.gen-…"): no client may declare a name under "amq.", so no team
        # can take a consumer's control queue before it exists. Bound to the control
        # exchange of each queue served: binding needs read on the exchange, which a team
        # user has for its own queues' only.
        q, tag = await self._consume("", handler, prefetch, exclusive=True, auto_delete=True)
        for queue in queues:
            exchange = self.topology.control_of(queue)
            async with read_refusals(self.user, f"control exchange {exchange!r}"), \
                    connection_errors():
                await q.bind(exchange, str(consumer_id))
        return tag

    async def watch_presence(self, on_gone: Callable[[str], None]) -> str | None:
        if self.connection is None:
            raise TransportUnavailable("not connected")
        async with connection_errors():
            return await watch_presence(self.connection, self.topology, vhost_of(self.url),
                                        on_gone)

    async def unsubscribe(self, tag: str) -> None:
        async with connection_errors():
            underlay = await self._channel().get_underlay_channel()
            await underlay.basic_cancel(tag)

    async def is_consuming(self, tag: str) -> bool:
        """False once the broker cancelled our consumer (queue deleted, failover...)."""
        if not self.is_open:
            return False
        async with connection_errors():
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
