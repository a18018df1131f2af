"""The consumer's doubts (``consumer/doubts.py``) on the in-memory store: after a take whose
reply was lost, exactly the rows it may have made ours that nothing runs are handed back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import pytest

from tests.conftest import Counted
from triggerflow.consumer.doubts import RETRY_MAX, Doubts, backoff
from triggerflow.store import NewDeferral, ProcessKind, StoreUnavailable, TriggerRef
from triggerflow.store.memory import MemoryStore
from triggerflow.store.memory.state import ManualClock

Q = "team-a"


class Lease:
    def __init__(self, me: int) -> None:
        self.me = me


class Runner:
    def __init__(self) -> None:
        self.running: set[int] = set()


class Admitting:
    """The consumer's admission as doubts see it: the claim lock, take-overs still
    starting, shutdown, and the runner."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.adopting = 0
        self.stopping = False
        self.runner = Runner()


class Case:
    """A consumer ``me`` that took triggers at store times of its choosing."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.store = MemoryStore(self.clock)
        self.lease = Lease(0)
        self.admission = Admitting()
        self.fired: set[int] = set()
        self.woken: list[TriggerRef] = []
        self.doubts = Doubts(self.store, self.lease, self.admission,  # type: ignore[arg-type]
                             lambda: self.fired, self.wake)

    async def wake(self, refs: Sequence[TriggerRef]) -> None:
        self.woken.extend(refs)

    async def start(self) -> None:
        self.lease.me = await self.store.register(ProcessKind.CONSUMER, "h", 1, [Q], 100, "v",
                                                  ttl=3600)

    async def take(self, n: int) -> list[int]:
        """``n`` new triggers claimed by ``me`` now (store time)."""
        kwargs = json.dumps({"moment": "2099-01-01T00:00:00+00:00"})
        ids = await self.store.defer([
            NewDeferral("d", f"t{self.clock.now}-{i}", "r", -1,
                        "triggerflow.triggers.temporal.DateTimeTrigger", kwargs, Q,
                        "execute_complete", "{}", 3600) for i in range(n)])
        assert len((await self.store.claim(self.lease.me, ids, [Q])).claimed) == n
        return ids

    def owner(self, trigger_id: int) -> int | None:
        return self.store.triggers[trigger_id].owner


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_only_rows_taken_since_the_doubt_that_nothing_runs_are_handed_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counted = Counted()
    monkeypatch.setattr("triggerflow.consumer.doubts.get_metrics", lambda: counted)
    case = Case()
    await case.start()
    [old] = await case.take(1)
    case.clock.advance(60)  # a minute later in the store: outside any window below
    began = now()
    running, fired, lost = await case.take(3)
    case.admission.runner.running.add(running)
    case.fired.add(fired)
    case.doubts.doubt(began)

    assert await case.doubts.settle() == 1
    assert case.woken == [TriggerRef(lost, Q)]
    assert case.owner(lost) is None and case.doubts.freed == 1
    assert counted.adds == [("released", 1, {"cause": "reply_lost"})]  # on the dashboards
    assert [case.owner(t) for t in (old, running, fired)] == [case.lease.me] * 3
    assert await case.doubts.settle() == 0  # settled: nothing is read again

    [later] = await case.take(1)
    case.doubts.doubt(now())
    assert await case.doubts.settle() == 1
    assert case.owner(later) is None and case.doubts.freed == 2  # counted over settles


class Releases(MemoryStore):
    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.releases = 0

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        self.releases += 1
        return await super().release_lost(me, ids, attempts)


async def test_a_doubt_with_everything_running_writes_nothing() -> None:
    case = Case()
    case.store = case.doubts.store = Releases(case.clock)
    await case.start()
    case.doubts.doubt(now())
    ids = await case.take(2)
    case.admission.runner.running.update(ids)
    assert await case.doubts.settle() == 0
    assert isinstance(case.store, Releases) and case.store.releases == 0


async def test_no_doubt_reads_nothing() -> None:
    case = Case()
    await case.start()
    await case.take(2)
    case.doubts.store = None  # type: ignore[assignment]  # any read would raise
    assert await case.doubts.settle() == 0


async def test_a_window_covers_the_oldest_unsettled_doubt() -> None:
    case = Case()
    await case.start()
    case.doubts.doubt(now() - 30)  # the first failure, 30 s ago
    case.clock.advance(-20)
    [early] = await case.take(1)  # taken 20 s before now
    case.clock.advance(20)
    case.doubts.doubt(now())  # a later failure does not shrink the window
    assert await case.doubts.settle() == 1
    assert case.owner(early) is None


async def test_rows_of_an_id_we_lost_since_are_left_to_the_reaper() -> None:
    case = Case()
    await case.start()
    first = case.lease.me
    case.doubts.doubt(now())
    ids = await case.take(2)
    case.lease.me = first + 100  # fenced and registered again before the store answered
    assert await case.doubts.settle() == 0
    assert [case.owner(t) for t in ids] == [first, first]


async def test_a_doubt_under_our_new_id_is_not_hidden_by_an_old_one() -> None:
    case = Case()
    await case.start()
    case.doubts.doubt(now())  # under the old id
    old = case.lease.me
    await case.start()  # registered again
    assert case.lease.me != old
    [t] = await case.take(1)
    case.doubts.doubt(now())
    assert await case.doubts.settle() == 1
    assert case.owner(t) is None


async def test_nothing_is_handed_back_at_shutdown() -> None:
    case = Case()
    await case.start()
    case.doubts.doubt(now())
    [t] = await case.take(1)
    case.admission.stopping = True  # shutdown hands back everything itself
    assert await case.doubts.settle() == 0
    assert case.owner(t) == case.lease.me


async def test_a_take_over_still_starting_is_waited_for_not_handed_back() -> None:
    case = Case()
    await case.start()
    case.doubts.doubt(now())
    [adopted] = await case.take(1)
    case.admission.adopting = 1

    async def started() -> None:
        await asyncio.sleep(0.05)
        case.admission.runner.running.add(adopted)
        case.admission.adopting = 0

    starting = asyncio.create_task(started())
    assert await case.doubts.settle() == 0
    await starting
    assert case.owner(adopted) == case.lease.me


class Failing(MemoryStore):
    """``taken_since`` fails the next ``failures`` times."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.failures = 0

    async def taken_since(self, me: int, seconds: float) -> list[tuple[int, int]]:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("still away")
        return await super().taken_since(me, seconds)


async def test_a_settle_the_store_refused_is_tried_again_until_it_answers() -> None:
    case = Case()
    store = Failing(case.clock)
    case.store = case.doubts.store = store
    await case.start()
    runs = asyncio.create_task(case.doubts.run())

    async def handed_back(t: int) -> None:
        async with asyncio.timeout(10):
            while case.owner(t) is not None:  # noqa: ASYNC110 - polls the store the loop changes
                await asyncio.sleep(0.01)

    try:
        for failures in (2, 1):  # twice in a row, then once after a settle that worked
            store.failures = failures
            case.doubts.doubt(now())
            [t] = await case.take(1)
            await handed_back(t)
            assert store.failures == 0 and not runs.done()
    finally:
        runs.cancel()
    assert len(case.woken) == 2


def test_retries_back_off_by_doubling_up_to_a_bound() -> None:
    assert backoff(0.5) == 1.0
    assert backoff(RETRY_MAX * 0.75) == RETRY_MAX
