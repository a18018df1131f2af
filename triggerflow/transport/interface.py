"""The transport: how wake-ups, events and control messages travel, named by what they do.

The consumer, writer, reaper and SDK depend on this Protocol only. ``rabbitmq`` implements it
with aio-pika (confirmed, persistent, mandatory publishes; quorum queues with a dead-letter
exchange); ``memory`` mirrors it in-process for fast tests.

Contract shared by every implementation:

* A publish returns once the message is durable on the broker (confirmed); it raises
  :class:`Unroutable` when no queue takes a mandatory message, :class:`PublishRefused` when
  the broker forbids it for this user, :class:`TransportUnavailable` when the connection is
  gone (reconnect, then retry or leave the re-send to the reaper).
* A :class:`Delivery` stays unacknowledged until ``ack``/``reject``; unacknowledged
  deliveries come back when the connection closes. The loops ack only after the work the
  message asked for is durable.
* Subscriptions can vanish without notice (a queue deleted, a broker failover). Callers
  keep them with :class:`triggerflow.transport.subscriptions.Subscriptions`, which checks
  and renews them through ``is_consuming``/``unsubscribe``/``subscribe``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

from triggerflow.errors import TriggerflowError
from triggerflow.wire import Event


class TransportError(TriggerflowError):
    """Base of the transport's errors."""


class TransportUnavailable(TransportError, ConnectionError):
    """The connection or channel is gone; reconnect before the next call."""


class AccessRefused(TransportError):
    """The broker refused our credentials or our virtual host: waiting does not fix that
    (unless a secret is being rotated)."""


class Unroutable(TransportError, RuntimeError):
    """A mandatory publish had no queue bound for its routing key."""


class PublishRefused(TransportError, RuntimeError):
    """The broker refused a publish for this user (topic or write permission)."""


class QueueFull(PublishRefused):
    """The queue is at its length limit (reject-publish): the broker nacked the publish."""


class SubscribeRefused(TransportError, RuntimeError):
    """This user may not read the queue (or bind to its control exchange): retrying cannot
    help, so the caller stops with this message instead of reconnecting."""


class Delivery(Protocol):
    """One received message. Ack or reject it exactly once."""

    @property
    def body(self) -> bytes: ...

    @property
    def routing_key(self) -> str: ...

    @property
    def user_id(self) -> str | None:
        """The publishing user as the broker verified it (None when not stamped)."""
        ...

    async def ack(self, *, multiple: bool = False) -> None:
        """Done with it (with ``multiple``: and every earlier delivery of its subscription)."""
        ...

    async def reject(self, *, requeue: bool = False) -> None: ...


DeliveryHandler = Callable[[Delivery], Awaitable[None]]


class QueueInfo(NamedTuple):
    ready: int  # messages waiting
    consumers: int


class Transport(Protocol):
    """A connection to the broker with the operations the loops use."""

    @property
    def user(self) -> str:
        """The user this connection publishes as (stamped on events)."""
        ...

    @property
    def is_open(self) -> bool: ...

    async def connect(self) -> None: ...

    async def close(self) -> None: ...

    async def wait_closed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the connection to drop; True if it did."""
        ...

    # -- topology -------------------------------------------------------------------------

    async def declare(self, team_queues: Sequence[str], *, delivery_limit: int = 5) -> None:
        """Idempotently declare exchanges, team queues, the events queue and dead letters."""
        ...

    async def queue_info(self, queue: str) -> QueueInfo | None:
        """Messages ready and consumers of ``queue``; None when it does not exist."""
        ...

    # -- subscriptions --------------------------------------------------------------------

    async def subscribe(self, queue: str, handler: DeliveryHandler, *, prefetch: int) -> str:
        """Consume an existing ``queue``; returns a subscription tag."""
        ...

    async def subscribe_events(self, handler: DeliveryHandler, *, prefetch: int) -> str:
        """Consume the shared events queue (the writer's input)."""
        ...

    async def subscribe_control(self, consumer_id: int, handler: DeliveryHandler, *,
                                prefetch: int, queues: Sequence[str]) -> str:
        """Consume the control messages addressed to ``consumer_id`` about ``queues`` (a
        private queue bound to each queue's control exchange)."""
        ...

    async def watch_presence(self, on_gone: Callable[[str], None]) -> str | None:
        """Make this connection's presence known and hear of others': returns the name of
        our presence queue, which the broker deletes the moment this connection closes, and
        calls ``on_gone(name)`` whenever another presence queue is deleted. None when the
        broker cannot tell (then only the lease fails over)."""
        ...

    async def unsubscribe(self, tag: str) -> None:
        """Stop a subscription; its unacked deliveries stay ours until acked or closed."""
        ...

    async def is_consuming(self, tag: str) -> bool:
        """False once the broker dropped the subscription (queue deleted, failover...)."""
        ...

    # -- publishing -----------------------------------------------------------------------

    async def publish_wakeups(self, ids_by_queue: Mapping[str, Sequence[int]], *,
                              chunk: int = 1000, rate: float | None = None,
                              traceparent: str | None = None) -> None:
        """Wake-ups naming trigger ids, ``chunk`` ids a message, at most ``rate`` ids/s."""
        ...

    async def publish_events(self, queue: str, events: Sequence[Event]) -> None:
        """Fired events of one queue, in one message stamped with this connection's user."""
        ...

    async def publish_control(self, consumer_id: int, op: str, ids: Sequence[int], *,
                              queue: str) -> None:
        """A control message (``op`` = "cancel") about ``queue``'s triggers to one consumer;
        dropped if it is gone."""
        ...

    async def dead_letter(self, body: bytes, reason: str, *, source: str) -> None:
        """Park an unusable message on the dead-letter exchange with a readable reason,
        under key ``source`` (a team user may use only its own queue's) and stamped with
        this connection's user."""
        ...
