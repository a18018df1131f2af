"""The parts of health that need no services: readiness while a subscription is renewed, the
bounded retry on refused credentials, and who counts as capacity (in-memory store)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from tenacity import wait_none

from triggerflow.health import Health
from triggerflow.refusals import ACCESS_ATTEMPTS, Refusals
from triggerflow.store import ProcessKind, StoreAccessRefused, StoreError, StoreUnavailable
from triggerflow.store.memory import MemoryStore
from triggerflow.transport import DeliveryHandler
from triggerflow.transport.memory import MemoryBroker, MemoryTransport
from triggerflow.transport.subscriptions import Subscriptions

log = logging.getLogger(__name__)


class GatedTransport(MemoryTransport):
    """Holds each subscribe at ``gate`` while ``hold`` is set: a broker round trip in flight."""

    def __init__(self, broker: MemoryBroker) -> None:
        super().__init__(broker)
        self.hold = False
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def subscribe(self, queue: str, handler: DeliveryHandler, *, prefetch: int) -> str:
        if self.hold:
            self.waiting.set()
            await self.gate.wait()
        return await super().subscribe(queue, handler, prefetch=prefetch)


async def _ignore(_delivery: object) -> None:
    return None


async def _subscribed(queue: str) -> tuple[GatedTransport, Subscriptions]:
    broker = MemoryBroker()
    broker.declare(queue)
    transport = GatedTransport(broker)
    subs = Subscriptions(transport, prefetch=10, check_interval=1.0)
    subs.add(queue, _ignore)
    await transport.connect()
    await subs.open()
    subs.connected.set()
    return transport, subs


async def test_a_renewed_subscription_stays_ready_a_dropped_one_does_not() -> None:
    transport, subs = await _subscribed("q")
    assert subs.problem() is None

    transport.hold = True  # the renewal's re-subscribe is in flight
    renewing = asyncio.ensure_future(subs.check())
    await transport.waiting.wait()
    assert subs.subscribed == []  # unsubscribed for the renewal...
    assert subs.problem() is None  # ...on purpose: still ready
    transport.gate.set()
    await renewing

    # Dropped by the broker (a queue deleted and declared again): not ready until back.
    transport.broker.cancel_subscription(subs._tags["q"])
    transport.gate.clear()
    transport.waiting.clear()
    resubscribing = asyncio.ensure_future(subs.check())
    await transport.waiting.wait()
    assert subs.problem() == "not subscribed to q"
    transport.gate.set()
    await resubscribing
    assert subs.problem() is None

    subs.connected.clear()
    assert subs.problem() == "not connected (connecting)"


async def test_a_healthy_subscription_is_renewed_once_per_renew_interval() -> None:
    """Each renewal hides the subscription from the broker's lists for a moment (the
    management API's until its next sample): a check renews only past ``renew_interval``,
    and a dropped subscription is re-subscribed at once all the same."""
    transport, subs = await _subscribed("q")
    subs.renew_interval = 3600.0
    first = subs._tags["q"]
    await subs.check()
    assert subs._tags["q"] == first  # within the interval: kept

    transport.broker.cancel_subscription(first)
    await subs.check()
    dropped_and_back = subs._tags["q"]
    assert dropped_and_back != first

    subs.renew_interval = 0.0
    await subs.check()
    assert subs._tags["q"] != dropped_and_back  # past the interval: renewed


def test_readiness_names_each_check_and_survives_a_broken_one() -> None:
    health = Health()
    assert health.ready() == (False, {"process": "starting"})
    health.check("lease", lambda: None)
    health.check("broker", lambda: "not connected (AccessRefused: ACCESS_REFUSED)")
    health.check("database", lambda: 1 / 0)  # type: ignore[return-value,arg-type]
    ok, report = health.ready()
    assert not ok
    assert list(report) == ["broker", "database", "lease"]
    assert report["broker"] == "not connected (AccessRefused: ACCESS_REFUSED)"
    assert report["database"].startswith("check failed: ZeroDivisionError")
    assert report["lease"] == "ok"
    assert health.live() == (True, {"loop": "ok"})  # no loop watched yet


async def test_refusals_end_after_the_bound_other_failures_do_not_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = Refusals("the database", StoreAccessRefused, log)
    calls: list[str] = []
    # Unreachable twice in between: only refusals count towards the bound.
    errors = [StoreAccessRefused("bad password"), StoreUnavailable("down"),
              StoreUnavailable("down")] + [StoreAccessRefused("bad password")] * ACCESS_ATTEMPTS

    async def attempt() -> None:
        error = errors[len(calls)]
        calls.append(type(error).__name__)
        raise error

    with pytest.raises(StoreAccessRefused):
        async for tried in refusals.retrying(StoreError, wait_none()):
            with tried:
                await attempt()
    assert calls.count("StoreAccessRefused") == ACCESS_ATTEMPTS
    assert calls.count("StoreUnavailable") == 2
    lines = [r.getMessage() for r in caplog.records if "refused our credentials" in r.getMessage()]
    assert len(lines) == ACCESS_ATTEMPTS - 1  # one per retry; the last one ends it
    assert lines[0].startswith(f"the database refused our credentials (attempt 1 of "
                               f"{ACCESS_ATTEMPTS}): bad password")


async def test_only_subscribed_consumers_count_as_capacity() -> None:
    store = MemoryStore()
    working = await store.register(ProcessKind.CONSUMER, "h", 1, ["q"], 100, "v", 30)
    refused = await store.register(ProcessKind.CONSUMER, "h", 2, ["q"], 100, "v", 30)
    assert await store.renew(refused, 30, 0, ["q"], subscribed=False) is not None
    renewal = await store.renew(working, 30, 80, ["q"], subscribed=True)
    assert renewal is not None
    assert (renewal.live_peers, renewal.peers_running) == (1, 80)
    assert await store.queue_consumers(["q"]) == {"q": 1}
    await store.renew(refused, 30, 0, ["q"], subscribed=True)  # connected after all
    renewal = await store.renew(working, 30, 80, ["q"], subscribed=True)
    assert renewal is not None and renewal.live_peers == 2
    assert await store.queue_consumers(["q"]) == {"q": 2}
