"""Reconnecting to the broker, without services: a lost connection that had been up a while
(a broker node gone behind a load balancer) is reconnected at once; one that drops right
after connecting backs off, so a broker that accepts and drops is not hammered."""

from __future__ import annotations

import asyncio
import logging

import pytest

from triggerflow.transport.memory import MemoryBroker, MemoryTransport
from triggerflow.transport.subscriptions import Subscriptions

BACKOFF = "the broker is unavailable"  # the line each backoff sleep logs


class CountingTransport(MemoryTransport):
    """Counts connections; with ``drop_at_once`` each one closes as soon as it is made."""

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__(broker)
        self.connects = 0
        self.drop_at_once = False
        self.connected_again = asyncio.Event()

    async def connect(self) -> None:
        await super().connect()
        self.connects += 1
        if self.connects > 1:
            self.connected_again.set()
        if self.drop_at_once:
            asyncio.get_running_loop().call_soon(asyncio.ensure_future, self.kill())


async def _ignore(_delivery: object) -> None:
    return None


async def test_a_lost_connection_that_had_lived_is_reconnected_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    broker = MemoryBroker()
    broker.declare("q")
    transport = CountingTransport(broker)
    subs = Subscriptions(transport, prefetch=10, check_interval=0.01)
    subs.add("q", _ignore)
    subs.stable_session = 0.05
    caplog.set_level(logging.WARNING)
    running = asyncio.create_task(subs.run())
    try:
        await asyncio.wait_for(subs.connected.wait(), 5)
        await asyncio.sleep(0.1)  # up longer than stable_session
        await transport.kill()
        await asyncio.wait_for(transport.connected_again.wait(), 5)
        assert "broker connection lost; reconnecting" in caplog.text  # it was lost
        assert BACKOFF not in caplog.text  # and taken again with no backoff sleep
        assert subs._tags.get("q")  # subscribed again

        # Dropped right after each connect: backs off (logged before each sleep).
        transport.drop_at_once = True
        caplog.clear()
        await transport.kill()
        for _ in range(500):
            if BACKOFF in caplog.text:
                break
            await asyncio.sleep(0.01)
        assert BACKOFF in caplog.text
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
