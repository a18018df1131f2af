"""Self-healing subscriptions: connect, subscribe, watch, and start over on any loss.

A subscription can vanish without the connection closing (RabbitMQ's ``basic.cancel`` when a
queue is deleted; on 3.10 a quorum queue deleted and declared again at once keeps a ghost
consumer that swallows deliveries without sending them). Only a fresh subscribe heals the
ghost, so with ``renew`` a check also re-subscribes (two frames) once ``renew_interval`` has
passed since the last renewal. Not on every check: each renewal drops the subscription from the
broker's counts for a moment and from the management API's consumer list until its next
statistics sample, and ``triggerflow status`` reads both. Reconnects back off
exponentially with jitter, so many processes do not return in step after a broker restart.
Works on any :class:`~triggerflow.transport.Transport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial

from tenacity import wait_exponential_jitter

from triggerflow.errors import TriggerflowError
from triggerflow.refusals import Refusals
from triggerflow.transport.interface import (
    AccessRefused,
    DeliveryHandler,
    SubscribeRefused,
    Transport,
)

log = logging.getLogger(__name__)

EVENTS = "<events>"  # the writer's input, named by the transport


class ConnectionLost(TriggerflowError):
    """The transport's connection closed while we were watching it."""


# A session that lived this long was healthy: its loss (a broker node gone behind a load
# balancer, a restart) is reconnected at once, and backed off only while connecting fails.
# One that drops sooner backs off too, so a broker that accepts and drops is not hammered.
STABLE_SESSION = 5.0


class Subscriptions:
    """The queues one loop consumes (and its control queue), kept subscribed.

    ``prefetch`` bounds unacked deliveries per subscription; ``check_interval`` is how often
    they are checked; ``renew`` re-subscribes on the first check after each
    ``renew_interval`` (see the module docstring; 0 renews on every check).
    While ``paused`` (a consumer at capacity) the team queues are not subscribed. A broker
    that refuses our credentials ``refusals.ACCESS_ATTEMPTS`` times in a row ends :meth:`run`
    with :class:`AccessRefused`; :meth:`problem` says why we are not subscribed, for readiness.
    """

    def __init__(self, transport: Transport, *, prefetch: int, check_interval: float,
                 renew: bool = True, renew_interval: float = 0.0) -> None:
        self.transport = transport
        self.prefetch = prefetch
        self.check_interval = check_interval
        self.renew = renew
        self.renew_interval = renew_interval
        self._renewed_at = time.monotonic()
        self.connected = asyncio.Event()
        self.paused = False
        self.stopped = False
        # name -> how to subscribe it (a team queue by name, or the events queue)
        self._wanted: dict[str, Callable[[], Awaitable[str]]] = {}
        self._tags: dict[str, str] = {}
        self._control: tuple[int, DeliveryHandler] | None = None
        self._control_tag: str | None = None
        self.refusals = Refusals("the broker", AccessRefused, log)
        self._renewing: set[str] = set()  # healthy subscriptions being renewed right now
        self._opening = asyncio.Lock()  # one open() at a time: two would subscribe twice
        # run on each new connection once subscribed (a consumer's presence queue)
        self.on_session: Callable[[], Awaitable[None]] | None = None
        self.stable_session = STABLE_SESSION
        self._connected_at: float | None = None  # when the current session was up

    def add(self, queue: str, handler: DeliveryHandler) -> None:
        self._wanted[queue] = partial(self.transport.subscribe, queue, handler,
                                      prefetch=self.prefetch)

    def add_events(self, handler: DeliveryHandler) -> None:
        self._wanted[EVENTS] = partial(self.transport.subscribe_events, handler,
                                       prefetch=self.prefetch)

    async def set_control(self, consumer_id: int, handler: DeliveryHandler) -> None:
        """Receive the control messages of ``consumer_id`` (again, after a new id)."""
        self._control = (consumer_id, handler)
        if self.transport.is_open:
            with contextlib.suppress(Exception):
                await self._subscribe_control()

    @property
    def subscribed(self) -> list[str]:
        return list(self._tags)

    def problem(self) -> str | None:
        """Why we are not consuming what we should, or None. Read from the health server's
        thread: it only copies attributes the loop sets."""
        if not self.connected.is_set():
            return f"not connected ({self.refusals.last_error or 'connecting'})"
        if self.paused or self.stopped:
            return None  # at capacity (or stopping) on purpose
        missing = set(self._wanted) - set(self._tags) - set(self._renewing)
        return f"not subscribed to {', '.join(sorted(missing))}" if missing else None

    # -- the loop ------------------------------------------------------------------------

    async def run(self, on_connected: Callable[[], None] | None = None,
                  on_lost: Callable[[], None] | None = None) -> None:
        """Keep everything subscribed until cancelled. ``on_connected`` runs after each
        (re)subscription, ``on_lost`` after each loss: unacked deliveries die with it.
        Raises :class:`SubscribeRefused` (after one error line) when the broker user may not
        read a wanted queue: reconnecting cannot change a permission."""
        while True:
            # A queue this user may not read is refused for good: not retried at all.
            async for attempt in self.refusals.retrying(
                    Exception, wait_exponential_jitter(multiplier=0.5, max=10, jitter=0.5),
                    never=SubscribeRefused):
                with attempt:
                    self._connected_at = None
                    try:
                        await self._session(on_connected)
                    except SubscribeRefused as exc:
                        log.error("%s; not retrying", exc)
                        raise
                    except ConnectionLost:
                        lived = time.monotonic() - (self._connected_at or time.monotonic())
                        if lived < self.stable_session:
                            raise  # dropped soon after connecting: back off
                        # A healthy session ended: this attempt counts as done, so the next
                        # loop reconnects at once (the first backoff cost 0.5-1 s of every
                        # broker node loss, measured by `bench nodeloss`).
                    finally:
                        self.connected.clear()
                        self._tags.clear()
                        self._control_tag = None
                        if on_lost is not None:
                            on_lost()
                        await self.transport.close()

    async def _session(self, on_connected: Callable[[], None] | None) -> None:
        await self.transport.connect()
        await self.open()
        if self._control is not None:
            await self._subscribe_control()
        if self.on_session is not None:
            await self.on_session()
        self.refusals.reset()
        self._connected_at = time.monotonic()
        self.connected.set()
        if on_connected is not None:
            on_connected()
        while self.transport.is_open:
            await self.check()
            await self.transport.wait_closed(self.check_interval)
        log.warning("broker connection lost; reconnecting")
        raise ConnectionLost

    # -- subscribing ---------------------------------------------------------------------

    async def open(self) -> None:
        """Subscribe every wanted queue not yet subscribed (unless paused or stopped)."""
        async with self._opening:
            if self.paused or self.stopped:
                return
            for name, subscribe in self._wanted.items():
                if name not in self._tags:
                    self._tags[name] = await subscribe()

    async def close(self) -> None:
        """Unsubscribe the team queues; deliveries in hand stay ours to ack."""
        for queue, tag in list(self._tags.items()):
            with contextlib.suppress(Exception):
                await self.transport.unsubscribe(tag)
            self._tags.pop(queue, None)

    async def pause(self) -> None:
        self.paused = True
        await self.close()

    async def resume(self) -> None:
        self.paused = False
        if self.transport.is_open:
            await self.open()

    async def stop(self) -> None:
        """No more subscriptions from now on (graceful shutdown)."""
        self.stopped = True
        await self.close()

    async def _subscribe_control(self) -> None:
        assert self._control is not None
        consumer_id, handler = self._control
        self._control_tag = await self.transport.subscribe_control(
            consumer_id, handler, prefetch=self.prefetch,
            queues=[q for q in self._wanted if q != EVENTS])

    async def check(self) -> None:
        """Re-subscribe what the broker dropped; with ``renew``, renew the rest too once
        ``renew_interval`` has passed."""
        renew = self.renew and time.monotonic() - self._renewed_at >= self.renew_interval
        if renew:
            self._renewed_at = time.monotonic()
        try:
            for queue, tag in list(self._tags.items()):
                consuming = await self.transport.is_consuming(tag)
                if consuming and not renew:
                    continue
                if not consuming:
                    log.warning("subscription to %s was cancelled by the broker; "
                                "re-subscribing", queue, extra={"queue": queue})
                elif queue != EVENTS and await self.transport.queue_info(queue) is None:
                    log.error("queue %s no longer exists on the broker", queue,
                              extra={"queue": queue})
                else:
                    self._renewing.add(queue)  # dropped on purpose, for a few milliseconds
                    with contextlib.suppress(Exception):
                        await self.transport.unsubscribe(tag)
                # pop, not del: a pause at capacity may have closed it while we awaited
                # (a KeyError here reconnected, which peers read as this consumer's death)
                self._tags.pop(queue, None)
            if self._control_tag and not await self.transport.is_consuming(self._control_tag):
                await self._subscribe_control()
            await self.open()
        finally:
            self._renewing.clear()
