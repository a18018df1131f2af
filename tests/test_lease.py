"""The lease's own arithmetic, in-process: its deadline never outlives the row it renewed."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

import pytest

from tests.test_loops import fast_settings
from triggerflow import __version__
from triggerflow.consumer.outcomes import Outcomes
from triggerflow.lease import Lease, LeaseLost
from triggerflow.model import EventKind
from triggerflow.runner import Held
from triggerflow.store import ProcessKind, Renewal, StoreUnavailable
from triggerflow.wire import Event

DB_NOW = time.time()  # the database's clock in scripted renewals (equal across compares)


class SlowStore:
    """Answers register and renew after ``delay`` seconds, as a loaded database would."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.expired = False

    async def register(self, *args: Any) -> int:
        await asyncio.sleep(self.delay)
        return 7

    async def renew(self, *args: Any, **kwargs: Any) -> Renewal | None:
        await asyncio.sleep(self.delay)
        return None if self.expired else Renewal(0, 0, 0, DB_NOW)


@pytest.mark.parametrize(("ttl", "interval"), [(2.0, 0.5), (10.0, 1.0), (30.0, 10.0), (1.0, 0.2)])
def test_budget_is_shorter_than_the_ttl(ttl: float, interval: float) -> None:
    lease = Lease(SlowStore(0), ProcessKind.CONSUMER, ttl=ttl, renew_interval=interval)  # type: ignore[arg-type]
    assert 0 < lease.budget < ttl


async def test_a_slow_renewal_does_not_stretch_the_deadline_past_the_row() -> None:
    """The row expires at the database's now() + ttl, and that now() can be as early as the
    moment the renewal was sent: the deadline counts from then, not from the answer."""
    store = SlowStore(0.3)
    lease = Lease(store, ProcessKind.CONSUMER, ttl=2.0, renew_interval=0.5)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    sent = loop.time()
    await lease.register()
    assert lease.deadline <= sent + lease.ttl - 0.2  # from the answer: sent + 0.3 + 1.75
    sent = loop.time()
    await lease.renew(0)
    assert lease.deadline <= sent + lease.ttl - 0.2  # from the answer: sent + 0.3 + 1.75
    assert lease.valid()
    store.expired = True
    with pytest.raises(LeaseLost, match="expired"):
        await lease.renew(0)


class ScriptedStore:
    """Answers renew from a script (a Renewal, None for "expired", or an error to raise) and
    counts registrations, each with a new id."""

    def __init__(self, *renewals: Renewal | Exception | None) -> None:
        self.renewals = list(renewals)
        self.registered = 0
        self.renew_args: list[tuple[Any, ...]] = []
        self.refuse_next_registration = False
        self.unregistered: list[int] = []
        self.register_args: list[tuple[Any, ...]] = []

    async def register(self, *args: Any) -> int:
        self.register_args.append(args)
        if self.refuse_next_registration:
            self.refuse_next_registration = False
            raise StoreUnavailable("starting up")
        self.registered += 1
        if self.registered > 2:
            raise RuntimeError("the third registration breaks")
        return 40 + self.registered

    async def unregister(self, me: int) -> None:
        self.unregistered.append(me)

    async def renew(self, *args: Any, subscribed: bool, clock_skew: float | None = None,
                    warming: bool = False) -> Renewal | None:
        self.renew_args.append((*args, subscribed))
        answer = self.renewals.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def scripted(*renewals: Renewal | Exception | None) -> tuple[ScriptedStore, Lease]:
    store = ScriptedStore(*renewals)
    lease = Lease(store, ProcessKind.WRITER, queues=["q"], ttl=2.0, renew_interval=0.5)  # type: ignore[arg-type]
    return store, lease


@pytest.mark.serial  # timing bound (0.1 s between setting and reading the lease): runs alone, after the parallel part
async def test_readiness_names_what_is_wrong_with_the_lease_and_the_store() -> None:
    _, lease = scripted()
    assert lease.problem() == "not registered"
    assert lease.database_problem() == "no round-trip yet"
    lease._stored(StoreUnavailable("connection refused"))
    assert lease.problem() == "not registered (StoreUnavailable: connection refused)"
    assert lease.database_problem() == "StoreUnavailable: connection refused"
    await lease.register()
    assert (lease.problem(), lease.database_problem()) == (None, None)
    lease.renewed_at = lease.store_ok_at = time.monotonic() - 1.9  # within the 2 s TTL
    assert (lease.problem(), lease.database_problem()) == (None, None)
    lease.renewed_at = lease.store_ok_at = time.monotonic() - 2.5
    assert lease.problem() == "not renewed for 2.5s (lease TTL 2s)"
    assert lease.database_problem() == "no round-trip for 2.5s"


async def test_a_writers_lease_is_kept_and_registered_anew_once_expired() -> None:
    store, lease = scripted(Renewal(0, 0, 0, DB_NOW), None, StoreUnavailable("down"))
    assert await lease.register() == 41
    lease.renewed_at = None
    await lease.keep(subscribed=False)
    assert (lease.me, lease.renewed_at is not None) == (41, True)
    assert store.renew_args == [(41, 2.0, 0, ["q"], False)]
    await lease.keep(subscribed=True)  # expired in the store: a new row
    assert (lease.me, store.registered, lease.problem()) == (42, 2, None)
    with pytest.raises(StoreUnavailable):
        await lease.keep(subscribed=True)
    assert lease.database_problem() == "StoreUnavailable: down"
    store.renewals.append(None)  # expired again, and registering anew fails: not registered
    with pytest.raises(RuntimeError):
        await lease.keep(subscribed=True)
    assert lease.problem() == "not registered"


async def test_a_renewal_that_fails_once_keeps_the_lease_and_an_expired_one_loses_it() -> None:
    store, lease = scripted(StoreUnavailable("blip"), Renewal(1, 2, 3, DB_NOW), None)
    await lease.register()
    with pytest.raises(StoreUnavailable):
        await lease.renew(5, subscribed=False)
    assert (lease.problem(), lease.database_problem()) == (None, "StoreUnavailable: blip")
    assert await lease.renew(5) == Renewal(1, 2, 3, DB_NOW)
    assert store.renew_args[-1] == (41, 2.0, 5, ["q"], True)
    assert (lease.problem(), lease.database_problem()) == (None, None)
    with pytest.raises(LeaseLost, match=r"^lease had expired in the database$"):
        await lease.renew(5)
    assert lease.problem() == "not registered"


async def test_an_overdue_renewal_is_lost_without_asking_the_store() -> None:
    store, lease = scripted(Renewal(0, 0, 0, DB_NOW))
    await lease.register()
    lease.deadline = asyncio.get_running_loop().time()
    with pytest.raises(LeaseLost, match=r"^renewal overdue \(loop stalled or database unreachable\)$"):
        await lease.renew(0)
    assert (store.renew_args, lease.problem()) == ([], "not registered")
    assert not lease.valid()


async def test_a_renewal_with_half_a_second_left_is_still_sent() -> None:
    _, lease = scripted(Renewal(0, 0, 0, DB_NOW))
    await lease.register()
    lease.deadline = asyncio.get_running_loop().time() + 0.5
    assert await lease.renew(0) == Renewal(0, 0, 0, DB_NOW)


async def test_a_renewal_answered_after_the_deadline_loses_the_lease() -> None:
    lease = Lease(SlowStore(5.0), ProcessKind.CONSUMER, ttl=2.0, renew_interval=0.5)  # type: ignore[arg-type]
    lease.renewed_at = time.monotonic()
    lease.deadline = asyncio.get_running_loop().time() + 0.1
    with pytest.raises(LeaseLost, match=r"^renewal timed out$"):
        await lease.renew(0)
    assert lease.problem() == "not registered (TimeoutError: renewal timed out)"
    assert lease.database_problem() == "TimeoutError: renewal timed out"


async def test_registration_is_retried_while_the_store_is_down_and_leave_names_the_row() -> None:
    store, lease = scripted()
    store.refuse_next_registration = True
    registering = asyncio.create_task(lease.register())
    async with asyncio.timeout(10):
        while not store.register_args:  # noqa: ASYNC110 - polls the scripted store
            await asyncio.sleep(0.01)
    # Waiting to retry (at least 0.5 s): readiness names the failure meanwhile.
    assert lease.problem() == "not registered (StoreUnavailable: starting up)"
    assert await registering == 41
    assert (lease.problem(), lease.database_problem()) == (None, None)
    row = (ProcessKind.WRITER, socket.gethostname(), os.getpid(), ["q"], 0, __version__, 2.0)
    assert store.register_args == [row, row]
    await lease.leave()
    assert store.unregistered == [41]


async def test_a_fenced_lease_holds_nothing_until_registered_anew_under_a_new_id() -> None:
    """What a claim or take-over checks after its statement: the lease still valid under the
    id it ran with. Re-registering after LeaseLost invalidates at once, before the store
    answers: a claim that commits meanwhile must not run what it took."""
    store, lease = scripted(None)
    old = await lease.register()
    assert lease.holds(old) and not lease.holds(old + 1)
    with pytest.raises(LeaseLost):
        await lease.renew(0)  # expired in the store
    store.refuse_next_registration = True  # the first try fails: the retry waits >= 0.5 s
    registering = asyncio.create_task(lease.register_anew())
    async with asyncio.timeout(10):
        while not store.register_args[1:]:  # noqa: ASYNC110 - polls the scripted store
            await asyncio.sleep(0.01)
    assert not lease.valid() and not lease.holds(old)  # invalid while it registers
    new = await registering
    assert new == lease.me != old
    assert lease.holds(new) and not lease.holds(old)


class Sink:
    """Records what the consumer's outcomes would publish."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add_many(self, events: list[Event]) -> None:
        self.events += events


async def test_nothing_is_emitted_once_the_deadline_passed_while_renewals_fail() -> None:
    """Renewals failing with a store error (the broker still up) keep the lease until its
    deadline, no longer: a trigger that fires after it is no longer surely ours (a peer's
    reaper may have taken it over at a raised attempt), so its event stays off the wire."""
    store = ScriptedStore(*(StoreUnavailable("database down") for _ in range(100)))
    lease = Lease(store, ProcessKind.CONSUMER, queues=["q"], ttl=0.4, renew_interval=0.1)  # type: ignore[arg-type]
    sink, fired = Sink(), list[Held]()
    outcomes = Outcomes(sink, lease, fast_settings(), fired.extend)  # type: ignore[arg-type]
    held = Held(7, 1, "q", "tests.triggers.EventAfter", None, None, None)
    await lease.register()
    outcomes.emit(held, EventKind.SUCCESS, {"n": 1})  # within the lease: published
    async with asyncio.timeout(10):
        while lease.valid():
            with pytest.raises(StoreUnavailable):
                await lease.renew(1)
            await asyncio.sleep(0.05)
    outcomes.emit(held, EventKind.SUCCESS, {"n": 2})
    outcomes.emit_many([held], EventKind.FAIL, {"error": "late"})
    assert [(e.trigger_id, e.attempt, e.payload) for e in sink.events] == [(7, 1, '{"n":1}')]
    assert fired == [held]
