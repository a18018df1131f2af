"""A spy on the events exchange: a queue of its own bound to it, recording every event
published (when it arrived, its trigger, attempt and kind). Tests and benchmarks use it to
show that a fault happened while events were in flight, and which attempts were on the wire."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aio_pika

from triggerflow.settings import Settings
from triggerflow.transport.rabbitmq import Topology
from triggerflow.wire import decode_events


@dataclass
class Spy:
    """A queue bound to the events exchange: every event published, with when it arrived."""

    seen: list[tuple[float, int, int, str]] = field(default_factory=list)  # (t, id, attempt, kind)

    def by_attempt(self, attempt: int) -> set[int]:
        return {tid for _, tid, a, _ in self.seen if a == attempt}


@contextlib.asynccontextmanager
async def spy_on_events(settings: Settings) -> AsyncIterator[Spy]:
    topo = Topology(settings.namespace)
    conn = await aio_pika.connect(settings.amqp_dsn())
    spy = Spy()
    try:
        ch = await conn.channel()
        exchange = await ch.get_exchange(topo.events)
        queue = await ch.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                for ev in decode_events(message.body):
                    spy.seen.append((time.monotonic(), ev.trigger_id, ev.attempt, ev.kind))

        await queue.consume(on_message)
        yield spy
    finally:
        await conn.close()
