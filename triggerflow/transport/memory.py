"""MemoryBroker / MemoryTransport: the :class:`~triggerflow.transport.Transport` in one process.

One :class:`MemoryBroker` plays the server; each process part (consumer, writer, SDK) opens
its own :class:`MemoryTransport` on it. Semantics kept from RabbitMQ: publishes to a missing
queue raise :class:`Unroutable` (wake-ups are mandatory); a subscription receives at most
``prefetch`` unacked deliveries; ``ack(multiple=True)`` acks every earlier delivery of the
connection; unacked deliveries return to the front of their queue when the connection
closes; rejected messages and ``dead_letter`` land in ``broker.dead``. For fault tests,
``broker.cancel_subscription`` drops a subscription silently (as a deleted queue does) and
``transport.kill`` closes a connection as a broker restart would.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from triggerflow.transport.interface import (
    DeliveryHandler,
    QueueInfo,
    TransportUnavailable,
    Unroutable,
)
from triggerflow.wire import Event, encode_control, encode_events, encode_wakeup

EVENTS_QUEUE = "events"


@dataclass
class Message:
    body: bytes
    routing_key: str
    user_id: str | None = None
    reason: str | None = None  # why it was dead-lettered


@dataclass
class _Subscription:
    tag: str
    queue: str
    handler: DeliveryHandler
    prefetch: int
    owner: MemoryTransport
    unacked: int = 0


@dataclass
class _Queue:
    messages: deque[Message] = field(default_factory=deque)
    subscriptions: list[_Subscription] = field(default_factory=list)
    turn: int = 0


class MemoryBroker:
    """The in-process server: named queues, the events queue, control queues, dead letters."""

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {EVENTS_QUEUE: _Queue()}
        self.dead: list[Message] = []
        self._tags = itertools.count(1)
        # presence: each connection's queue name, and who hears of one going
        self._presence = itertools.count(1)
        self.watchers: dict[str, Callable[[str], None]] = {}

    def presence_gone(self, name: str) -> None:
        """The broker deleted ``name`` (its connection closed): every other watcher hears."""
        if self.watchers.pop(name, None) is not None:
            for on_gone in list(self.watchers.values()):
                asyncio.get_running_loop().call_soon(on_gone, name)

    def declare(self, *names: str) -> None:
        for name in names:
            self.queues.setdefault(name, _Queue())

    def ready(self, queue: str) -> list[Message]:
        return list(self.queues[queue].messages)

    def cancel_subscription(self, tag: str) -> None:
        """Drop a subscription without telling its owner (RabbitMQ's silent loss)."""
        for q in self.queues.values():
            q.subscriptions = [s for s in q.subscriptions if s.tag != tag]

    def subscription_tags(self, queue: str) -> list[str]:
        return [s.tag for s in self.queues[queue].subscriptions]

    def _put(self, queue: str, message: Message, *, front: bool = False) -> None:
        q = self.queues[queue]
        if front:
            q.messages.appendleft(message)
        else:
            q.messages.append(message)
        self._dispatch(queue)

    def _dispatch(self, queue: str) -> None:
        """Hand ready messages to subscriptions with room, round robin."""
        q = self.queues.get(queue)
        if q is None:
            return
        while q.messages:
            open_subs = [s for s in q.subscriptions if s.unacked < s.prefetch]
            if not open_subs:
                return
            sub = open_subs[q.turn % len(open_subs)]
            q.turn += 1
            sub.owner._deliver(sub, q.messages.popleft())


class MemoryDelivery:
    """A delivered message; ack/reject talk back to its connection."""

    def __init__(self, transport: MemoryTransport, sub: _Subscription, tag: int,
                 message: Message) -> None:
        self._transport = transport
        self._sub = sub
        self.tag = tag
        self.message = message
        self.settled = False

    @property
    def body(self) -> bytes:
        return self.message.body

    @property
    def routing_key(self) -> str:
        return self.message.routing_key

    @property
    def user_id(self) -> str | None:
        return self.message.user_id

    async def ack(self, *, multiple: bool = False) -> None:
        self._transport._settle(self, multiple=multiple)

    async def reject(self, *, requeue: bool = False) -> None:
        self._transport._settle(self, multiple=False)
        if requeue:
            self._transport.broker._put(self._sub.queue, self.message, front=True)
        else:
            self._transport.broker.dead.append(
                Message(self.message.body, self.message.routing_key, reason="rejected"))


class MemoryTransport:
    """One connection to a :class:`MemoryBroker`, publishing as ``user``."""

    def __init__(self, broker: MemoryBroker, *, user: str = "guest") -> None:
        self.broker = broker
        self._user = user
        self._open = False
        self._closed = asyncio.Event()
        self._closed.set()
        self._tags = itertools.count(1)
        self._unacked: dict[int, MemoryDelivery] = {}
        self._subs: dict[str, _Subscription] = {}
        self._handlers: set[asyncio.Future[None]] = set()  # strong refs until done
        self.presence: str | None = None
        self.published_wakeups: list[tuple[str, list[int]]] = []  # for assertions

    @property
    def user(self) -> str:
        return self._user

    @property
    def is_open(self) -> bool:
        return self._open

    async def connect(self) -> None:
        self._open = True
        self._closed.clear()

    async def close(self) -> None:
        if not self._open:
            return
        self._open = False
        for sub in self._subs.values():
            self.broker.cancel_subscription(sub.tag)
        self._subs.clear()
        # Unacked deliveries go back to the front of their queues, oldest first.
        for delivery in sorted(self._unacked.values(), key=lambda d: -d.tag):
            delivery.settled = True
            self.broker._put(delivery._sub.queue, delivery.message, front=True)
        self._unacked.clear()
        self._closed.set()
        if self.presence is not None:
            self.broker.presence_gone(self.presence)
            self.presence = None

    async def kill(self) -> None:
        """Lose the connection as a broker restart would."""
        await self.close()

    async def wait_closed(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):
                await self._closed.wait()
        except TimeoutError:
            return False
        return True

    def _check(self) -> None:
        if not self._open:
            raise TransportUnavailable("not connected")

    # -- topology -------------------------------------------------------------------------

    async def declare(self, team_queues: Sequence[str], *, delivery_limit: int = 5) -> None:
        self._check()
        self.broker.declare(*team_queues)

    async def queue_info(self, queue: str) -> QueueInfo | None:
        self._check()
        q = self.broker.queues.get(queue)
        return None if q is None else QueueInfo(len(q.messages), len(q.subscriptions))

    # -- subscriptions --------------------------------------------------------------------

    async def subscribe(self, queue: str, handler: DeliveryHandler, *, prefetch: int) -> str:
        self._check()
        q = self.broker.queues.get(queue)
        if q is None:
            raise TransportUnavailable(f"no queue {queue!r} (passive declare failed)")
        sub = _Subscription(f"ctag-{next(self.broker._tags)}", queue, handler, prefetch, self)
        q.subscriptions.append(sub)
        self._subs[sub.tag] = sub
        self.broker._dispatch(queue)
        return sub.tag

    async def subscribe_events(self, handler: DeliveryHandler, *, prefetch: int) -> str:
        return await self.subscribe(EVENTS_QUEUE, handler, prefetch=prefetch)

    async def subscribe_control(self, consumer_id: int, handler: DeliveryHandler, *,
                                prefetch: int, queues: Sequence[str]) -> str:
        self.broker.declare(f"control.{consumer_id}")
        return await self.subscribe(f"control.{consumer_id}", handler, prefetch=prefetch)

    async def watch_presence(self, on_gone: Callable[[str], None]) -> str | None:
        self._check()
        self.presence = f"presence.{next(self.broker._presence)}"
        self.broker.watchers[self.presence] = on_gone
        return self.presence

    async def unsubscribe(self, tag: str) -> None:
        self._check()
        self.broker.cancel_subscription(tag)
        self._subs.pop(tag, None)

    async def is_consuming(self, tag: str) -> bool:
        if not self._open or tag not in self._subs:
            return False
        return any(s.tag == tag for q in self.broker.queues.values() for s in q.subscriptions)

    def _deliver(self, sub: _Subscription, message: Message) -> None:
        delivery = MemoryDelivery(self, sub, next(self._tags), message)
        self._unacked[delivery.tag] = delivery
        sub.unacked += 1
        task: asyncio.Future[None] = asyncio.ensure_future(sub.handler(delivery))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _settle(self, delivery: MemoryDelivery, *, multiple: bool) -> None:
        self._check()
        if delivery.settled:
            raise TransportUnavailable("delivery already settled or its channel closed")
        tags = [t for t in self._unacked if t <= delivery.tag] if multiple else [delivery.tag]
        queues = set()
        for tag in tags:
            d = self._unacked.pop(tag)
            d.settled = True
            d._sub.unacked -= 1
            queues.add(d._sub.queue)
        for queue in queues:
            self.broker._dispatch(queue)

    # -- publishing -----------------------------------------------------------------------

    async def publish_wakeups(self, ids_by_queue: Mapping[str, Sequence[int]], *,
                              chunk: int = 1000, rate: float | None = None,
                              traceparent: str | None = None) -> None:
        self._check()
        for queue, ids in ids_by_queue.items():
            if queue not in self.broker.queues:
                raise Unroutable(f"could not route key {queue!r}: no queue is bound to it")
            for i in range(0, len(ids), chunk):
                part = list(ids[i : i + chunk])
                self.published_wakeups.append((queue, part))
                self.broker._put(queue, Message(encode_wakeup(part), queue))

    async def publish_events(self, queue: str, events: Sequence[Event]) -> None:
        self._check()
        self.broker._put(EVENTS_QUEUE, Message(encode_events(list(events)), queue, self._user))

    async def publish_control(self, consumer_id: int, op: str, ids: Sequence[int], *,
                              queue: str) -> None:
        self._check()
        name = f"control.{consumer_id}"
        if name in self.broker.queues:  # not mandatory: a gone consumer's message is dropped
            self.broker._put(name, Message(encode_control(op, list(ids)), str(consumer_id)))

    async def dead_letter(self, body: bytes, reason: str, *, source: str) -> None:
        self._check()
        self.broker.dead.append(Message(body, source, reason=reason))
