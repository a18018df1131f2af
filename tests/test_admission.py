"""A consumer's admission and a process's named tasks, in-process: the room is counted in
one place, subscriptions pause at capacity and resume with 10% to spare, and a task that
ends on its own is named and stops the process."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from triggerflow.consumer.admission import Admission
from triggerflow.lifecycle import Background, Tasks
from triggerflow.settings import Settings
from triggerflow.store import Taker


class Running:
    """The runner as admission sees it: how many triggers run."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


class Lease:
    me = 5

    def valid(self) -> bool:
        return True

    def holds(self, me: int) -> bool:
        return me == self.me


class Subscriptions:
    def __init__(self) -> None:
        self.paused = True
        self.calls: list[str] = []

    async def pause(self) -> None:
        self.calls.append("pause")

    async def resume(self) -> None:
        self.calls.append("resume")


class Delivered:
    def __init__(self, routing_key: str) -> None:
        self.routing_key = routing_key


def admission(capacity: int, running: Running, subscriptions: Any = None) -> Admission:
    settings = Settings.without_environment({"queues": ["a", "b"], "capacity": capacity, "claim_batch": 3})
    fakes: Any = (None, Lease(), running, subscriptions or Subscriptions())  # store, lease, runner, subs
    unused: Any = None  # start and republish: no take-over runs here
    return Admission(settings, *fakes, Background(), start=unused, republish=unused)


async def test_room_counts_running_and_pending_and_is_none_on_a_skewed_clock() -> None:
    running = Running(4)
    a = admission(10, running)
    assert a.room() == 0  # clock not compared yet: nothing is taken
    a.clock_ok = True
    a.deliver([1, 2], Delivered("a"))
    assert (a.held, a.room(), a.room(counting_pending=False)) == (6, 4, 6)
    assert a.take_locally("a", [3, 4, 5, 6, 7]) == [7]  # four fit, in claim_batch chunks
    assert a.pending == 6 and a.room() == 0
    assert a.take_locally("other", [8]) == [8]  # not our queue
    batch = await a.next_batch()
    # Gathered while under claim_batch (3) ids; the reaper's second chunk waits its turn.
    assert [ids for ids, _ in batch] == [[1, 2], [3, 4, 5]]
    assert [ids for ids, _ in await a.next_batch()] == [[6]]
    running.n = 12
    assert a.room() == 0  # over capacity: never negative
    a.clock_ok = False
    assert a.room(counting_pending=False) == 0
    assert a.keeps(5) is False  # a good lease, a bad clock: peers run it


async def test_a_claim_batch_keeps_what_fits_and_sends_the_rest_back_to_its_queue() -> None:
    a = admission(10, Running(7))
    a.clock_ok = True
    a.deliver([1, 2], Delivered("a"))
    a.deliver([3, 4], Delivered("b"))
    a.deliver([5], None)  # freed by our own reaper: nowhere to send it but its next pass
    batch = [await a.next_batch(), await a.next_batch()]
    assert a.fit([w for b in batch for w in b]) == ([1, 2, 3], {"b": [4]})


async def test_a_claim_batch_leaves_room_for_a_take_over_still_starting() -> None:
    """Adopted triggers are ours before they run: a claim beside them must not fill their
    room too (a zone's survivors held 42,000 for a capacity of 40,000 without this)."""
    a = admission(10, Running(2))
    a.clock_ok = True
    started = asyncio.Event()
    release = asyncio.Event()

    async def start(specs: list[Any]) -> None:
        started.set()
        await release.wait()

    a.start = start
    await a.adopt(Taker(5, 6), [object()] * 6)  # type: ignore[list-item]
    await started.wait()
    assert (a.adopting, a.held, a.room()) == (6, 8, 2)
    a.deliver([1, 2, 3, 4], Delivered("a"))
    batch = await a.next_batch()
    assert a.fit(batch) == ([1, 2], {"a": [3, 4]})  # 2 + 6 starting + 2 = capacity
    release.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert a.adopting == 0


async def test_subscriptions_pause_at_capacity_and_resume_with_a_tenth_to_spare() -> None:
    running, subs = Running(0), Subscriptions()
    a = admission(10, running, subs)
    a.update_flow()  # paused from the start, no clock yet: stays paused
    a.clock_ok = True
    a.update_flow()
    assert subs.paused is False
    running.n = 10
    a.update_flow()
    assert subs.paused is True
    running.n = 9  # 10% free is not enough
    a.update_flow()
    assert subs.paused is True
    running.n = 8
    a.update_flow()
    await asyncio.sleep(0)
    assert (subs.paused, subs.calls) == (False, ["resume", "pause", "resume"])


async def test_a_take_over_is_offered_only_with_room_and_while_not_stopping() -> None:
    a = admission(10, Running(8))
    async with a.taking() as taker:
        assert taker is None  # no clock yet
    a.clock_ok = True
    async with a.taking() as taker:
        assert taker == Taker(5, 2)
        assert a.lock.locked()  # no claim in between
    a.stopping = True
    async with a.taking() as taker:
        assert taker is None


async def test_a_task_that_ends_on_its_own_is_named_and_the_rest_are_cancelled(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("boom")

    tasks = Tasks()
    kept = tasks.start("broker", asyncio.sleep(60))
    other = tasks.start("claims", asyncio.sleep(60))
    tasks.start("renewals", broken())
    with caplog.at_level(logging.ERROR, logger="triggerflow.lifecycle"):
        assert await tasks.until(asyncio.Event()) is True
    assert [r.getMessage() for r in caplog.records] == ["task renewals stopped unexpectedly; shutting down"]
    await tasks.cancel(keep={"broker"})
    assert other.cancelled() and not kept.done()
    await tasks.cancel()
    assert kept.cancelled()


async def test_stop_ends_the_wait_with_nothing_reported() -> None:
    stop = asyncio.Event()
    async with Tasks() as tasks:
        task = tasks.start("claims", asyncio.sleep(60))
        stop.set()
        assert await tasks.until(stop) is False
        assert not task.done()
    assert task.cancelled()
