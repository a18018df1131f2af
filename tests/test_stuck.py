"""Nothing stuck, one bad trigger harms only its own task (issue #10): the loop decisions, on the
in-memory store and transport. What needs the real services is in ``test_stuck_faults.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import pytest

from tests.test_loops import QUEUE, fast_settings, key, running, until
from triggerflow.consumer import Consumer
from triggerflow.model import EventKind, TaskState
from triggerflow.runner import Held, TriggerRunner
from triggerflow.sdk import Deferral, DeferralError
from triggerflow.store import NewDeferral, StoreUnavailable
from triggerflow.testing import InMemory, MemoryStore
from triggerflow.triggers import BaseTrigger, DateTimeTrigger, TimeDeltaTrigger, TriggerEvent
from triggerflow.wire import decode_wakeup, encode_json

BAD_MOMENT = "0001-01-01T00:00:00+14:00"  # parses, but its event (a datetime) cannot be built


@pytest.fixture
def mem() -> InMemory:
    m = InMemory()
    m.broker.declare(QUEUE)
    return m


async def _defer_raw(mem: InMemory, i: int, classpath: str, kwargs: dict[str, Any],
                     timeout: float = 3600) -> int:
    """A row as an older SDK (or a hand-written INSERT) could have stored it: unchecked."""
    [tid] = await mem.store.defer([NewDeferral(
        "dag", f"t{i}", "run", -1, classpath, encode_json(kwargs), QUEUE, "execute_complete",
        "{}", timeout)])
    transport = mem.transport()
    await transport.connect()
    await transport.publish_wakeups({QUEUE: [tid]})
    return tid


# ----------------------------------------------------------------------------- one bad trigger


async def test_sdk_refuses_a_moment_whose_event_cannot_be_built(mem: InMemory) -> None:
    async with mem.client(fast_settings()) as client:
        with pytest.raises(DeferralError, match="no usable deadline"):
            await client.defer(key(1), DateTimeTrigger(BAD_MOMENT), queue=QUEUE)
    assert not mem.store.triggers


async def test_a_bad_moment_fails_its_own_task_and_the_other_timers_still_fire(
    mem: InMemory,
) -> None:
    s = fast_settings()
    consumer = Consumer(s, mem.store, mem.transport())
    from triggerflow.writer import Writer

    writer = Writer(s, mem.store, mem.transport())
    async with running(consumer, writer), mem.client(s) as client:
        bad = await _defer_raw(mem, 0, "triggerflow.triggers.temporal.DateTimeTrigger",
                               {"moment": BAD_MOMENT})
        await client.defer_many([Deferral(key(i), TimeDeltaTrigger(timedelta(seconds=0.5)), QUEUE)
                                 for i in range(1, 201)])
        await until(lambda: all(mem.store.task(key(i)).state == TaskState.SCHEDULED
                                for i in range(1, 201)), timeout=5)
        await until(lambda: mem.store.task(key(0)).state == TaskState.SCHEDULED)
    failed = mem.store.task(key(0))
    assert bad not in mem.store.triggers
    assert failed.next_method == "__fail__"
    assert "DateTimeTrigger" in failed.next_kwargs["message"]
    assert all(mem.store.task(key(i)).next_method == "execute_complete" for i in range(1, 201))


class _ExplodingDeadline(DateTimeTrigger):
    """A timer whose ``deadline()`` raises once the consumer asks for it."""

    def deadline(self) -> float:
        raise RuntimeError("boom")

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._ExplodingDeadline", {"moment": self.moment.isoformat()})


class _ExplodingPayload(DateTimeTrigger):
    """A timer whose event payload raises when it fires."""

    @staticmethod
    def timer_payload(deadline: float) -> Any:
        if deadline > time.time() - 60:  # only when it fires, not in the defer-time check
            raise RuntimeError("payload boom")
        return None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._ExplodingPayload", {"moment": self.moment.isoformat()})


async def test_errors_from_deadline_and_payload_fail_only_their_tasks(mem: InMemory) -> None:
    s = fast_settings()
    consumer = Consumer(s, mem.store, mem.transport())
    soon = (TimeDeltaTrigger(timedelta(seconds=0.3)).moment).isoformat()
    async with running(consumer):
        # In one claim batch: the bad start sits between good ones.
        ids = [await _defer_raw(mem, 0, f"{__name__}._ExplodingDeadline", {"moment": soon}),
               await _defer_raw(mem, 1, f"{__name__}._ExplodingPayload", {"moment": soon})]
        ids += [await _defer_raw(mem, i, "triggerflow.triggers.temporal.DateTimeTrigger",
                                 {"moment": soon}) for i in range(2, 12)]
        events: list[tuple[int, str]] = []
        await until(lambda: _sent(consumer, events) >= 12, timeout=5)
    kinds = dict(events)
    assert kinds[ids[0]] == kinds[ids[1]] == str(EventKind.FAIL)
    assert all(kinds[i] == str(EventKind.RESUME) for i in ids[2:])


def _sent(consumer: Consumer, into: list[tuple[int, str]]) -> int:
    """Events the consumer published (read from the in-memory events queue, no writer)."""
    from triggerflow.transport.memory import EVENTS_QUEUE
    from triggerflow.wire import decode_events

    into.clear()
    broker = consumer.transport.broker  # type: ignore[attr-defined]
    for message in broker.ready(EVENTS_QUEUE):
        into.extend((e.trigger_id, e.kind) for e in decode_events(message.body))
    return len(into)


# ----------------------------------------------------------------------------- runner memory


class _Quick(BaseTrigger):
    def __init__(self, **kwargs: Any) -> None:
        self.cleanups = 0

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{__name__}._Quick", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        yield TriggerEvent(1)

    async def cleanup(self) -> None:
        self.cleanups += 1


class _Forever(_Quick):
    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.Event().wait()
        yield TriggerEvent(1)


def _held(i: int, attempt: int = 1, timeout: float = 7 * 86400) -> Held:
    return Held(i, attempt, QUEUE, "x.Y", None, time.time() + timeout, None)


async def test_finished_coroutine_triggers_leave_no_heap_entries_behind() -> None:
    fired: list[int] = []
    runner = TriggerRunner(lambda held, kind, payload: fired.append(held.id))
    for i in range(20_000):
        runner.start(_held(i), _Quick())
        if i % 100 == 99:
            await asyncio.sleep(0)
    await until(lambda: len(fired) == 20_000)
    assert not runner.running
    assert len(runner._heap) <= 2048, len(runner._heap)


async def test_a_redelivered_trigger_replaces_its_running_task_and_cancels_it() -> None:
    runner = TriggerRunner(lambda held, kind, payload: None)
    first, second = _Forever(), _Forever()
    runner.start(_held(7), first)
    await asyncio.sleep(0)
    old_task = runner.running[7].task
    runner.start(_held(7, attempt=2), second)
    await asyncio.sleep(0.05)
    assert old_task is not None and old_task.cancelled()
    assert first.cleanups == 1 and second.cleanups == 0
    assert runner.running[7].attempt == 2 and runner.current_task_count() == 1
    runner.cancel()
    await runner.wait_cleanups()


# ----------------------------------------------------------------------------- transient errors


class FlakyStore(MemoryStore):
    """The first ``claims`` claims, sweeps and probation clears fail as a lost database."""

    def __init__(self, claims: int = 0, sweeps: int = 0, clears: int = 0) -> None:
        super().__init__()
        self.claims, self.sweeps, self.clears = claims, sweeps, clears

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> Any:
        if self.claims:
            self.claims -= 1
            raise StoreUnavailable("connection reset")
        return await super().claim(me, ids, queues)

    async def sweep_cancelled(self, me: int) -> list[int]:
        if self.sweeps:
            self.sweeps -= 1
            raise StoreUnavailable("connection reset")
        return await super().sweep_cancelled(me)

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        if self.sweeps:
            self.sweeps -= 1
            raise StoreUnavailable("connection reset")
        await super().forget(me, ids)

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        if self.clears:
            self.clears -= 1
            raise StoreUnavailable("connection reset")
        await super().clear_probation(me, ids)


@pytest.mark.serial  # timing bound (requeued within 3 s): runs alone, after the parallel part
async def test_a_failed_claim_requeues_its_wakeups_at_once() -> None:
    store = FlakyStore(claims=1)
    mem = InMemory(store)
    mem.broker.declare(QUEUE)
    transport = mem.transport()
    s = fast_settings(unclaimed_grace=60)  # the reaper's re-send must not be what saves it
    consumer = Consumer(s, store, transport)
    async with running(consumer), mem.client(s) as client:
        started = time.monotonic()
        [tid] = await client.defer_many([Deferral(key(1), TimeDeltaTrigger(timedelta(hours=1)),
                                                  QUEUE)])
        # No channel is closed here: only a prompt requeue brings the wake-up back.
        await until(lambda: store.triggers[tid].owner == consumer.me, timeout=3)
    assert store.claims == 0 and time.monotonic() - started < 3
    assert not transport._unacked


async def test_transient_errors_in_sweep_and_probation_do_not_stop_the_consumer() -> None:
    store = FlakyStore(sweeps=3, clears=2)
    mem = InMemory(store)
    mem.broker.declare(QUEUE)
    consumer = Consumer(fast_settings(), store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        [tid] = await client.defer_many([Deferral(key(1), TimeDeltaTrigger(timedelta(hours=1)),
                                                  QUEUE)])
        await until(lambda: tid in consumer.runner.running)
        store.task(key(1)).state = TaskState.FAILED  # the sweep must drop it, errors or not
        await until(lambda: tid not in consumer.runner.running and store.sweeps == 0)
        # A suspect on probation: clearing it fails twice, then succeeds.
        [sus] = await client.defer_many([Deferral(key(2), TimeDeltaTrigger(timedelta(hours=1)),
                                                  QUEUE)])
        await until(lambda: sus in consumer.runner.running)
        consumer.runner.cancel([sus])
        await store.release(consumer.me, [sus])
        store.triggers[sus].failures = 2
        consumer.probation.suspects.set()
        await until(lambda: store.clears == 0 and store.triggers[sus].failures == 0, timeout=8)
        assert all(not t.done() for t in consumer.tasks.tasks)


# ----------------------------------------------------------------------------- reconciliation


async def test_a_lost_event_is_reconciled_and_its_task_still_leaves_deferred(
    mem: InMemory,
) -> None:
    from triggerflow.transport.memory import EVENTS_QUEUE
    from triggerflow.writer import Writer

    s = fast_settings(reconcile_after=0.4)
    consumer = Consumer(s, mem.store, mem.transport())
    async with running(consumer), mem.client(s) as client:
        ids = await client.defer_many([Deferral(key(i), TimeDeltaTrigger(timedelta(seconds=0.1)),
                                                QUEUE) for i in range(5)])
        await until(lambda: len(mem.broker.ready(EVENTS_QUEUE)) >= 1 and not consumer.runner)
        mem.broker.queues[EVENTS_QUEUE].messages.clear()  # dead-lettered after its limit, say
        assert all(mem.store.triggers[i].owner == consumer.me for i in ids)  # held, not run
        await until(lambda: consumer.reconciler.lost == 5, timeout=3)
        writer = Writer(s, mem.store, mem.transport())
        async with running(writer):
            await until(lambda: all(mem.store.task(key(i)).state == TaskState.SCHEDULED
                                    for i in range(5)), timeout=3)
    assert all(mem.store.task(key(i)).next_method == "execute_complete" for i in range(5))


class SlowRegisterStore(MemoryStore):
    """Registrations after the first wait for ``gate``: a consumer re-registering slowly."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.registrations = 0

    async def register(self, *args: Any, **kwargs: Any) -> int:
        self.registrations += 1
        if self.registrations > 1:
            await self.gate.wait()
        return await super().register(*args, **kwargs)


async def test_no_claim_is_made_under_an_expired_id_while_re_registering() -> None:
    store = SlowRegisterStore()
    mem = InMemory(store)
    mem.broker.declare(QUEUE)
    consumer = Consumer(fast_settings(), store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        await until(lambda: consumer.me != 0)
        old = consumer.me
        store.processes[old].expires_at = 0  # a peer declared us dead
        await until(lambda: store.registrations == 2)  # fenced, re-registering
        ids = await client.defer_many([_far(i) for i in range(20)])
        await asyncio.sleep(0.3)
        assert not any(store.triggers[i].owner == old for i in ids), "claimed under a dead id"
        store.gate.set()
        await until(lambda: consumer.me != old)
        await until(lambda: all(store.triggers[i].owner == consumer.me for i in ids), timeout=5)
        assert all(i in consumer.runner.running for i in ids)


def _far(i: int) -> Deferral:
    return Deferral(key(i), TimeDeltaTrigger(timedelta(hours=1)), QUEUE)


# ----------------------------------------------------------------------------- blame, balance


async def test_an_outage_that_fences_everyone_blames_no_trigger() -> None:
    from triggerflow.store import ProcessKind
    from triggerflow.testing import ManualClock

    clock = ManualClock()
    mem = InMemory.with_clock(clock)
    mem.broker.declare(QUEUE)
    async with mem.client(fast_settings()) as client:
        ids = await client.defer_many([_far(i) for i in range(4)])
    store = mem.store
    for _ in range(3):  # three outages: every lease (the writer's too) expires together
        await store.register(ProcessKind.WRITER, "h", 2, [], 0, "v", ttl=3)
        me = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=3)
        assert len((await store.claim(me, ids, [QUEUE])).claimed) == 4
        clock.advance(10)
        await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=3)  # back
        assert len((await store.reap_dead([QUEUE], 30)).freed) == 4
    assert all(store.triggers[i].failures == 0 for i in ids)
    # A death a peer renewing on the same lease lived through is still counted.
    peer = await store.register(ProcessKind.CONSUMER, "h", 2, [QUEUE], 10, "v", ttl=3)
    me = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=3)
    await store.claim(me, ids, [QUEUE])
    clock.advance(2)
    await store.renew(peer, 3, 0, [QUEUE])
    clock.advance(2)
    await store.reap_dead([QUEUE], 30)
    assert all(store.triggers[i].failures == 1 for i in ids)


async def test_probation_takes_no_more_suspects_than_free_capacity(mem: InMemory) -> None:
    s = fast_settings(capacity=10, probation_seconds=30)
    async with mem.client(s) as client:
        ids = await client.defer_many([_far(i) for i in range(40)])
    for i in ids:
        mem.store.triggers[i].failures = 2
    consumer = Consumer(s, mem.store, mem.transport())
    async with running(consumer):
        consumer.probation.suspects.set()
        await until(lambda: len(consumer.runner) > 0)
        await asyncio.sleep(0.3)
        assert len(consumer.runner) <= 10
        assert sum(1 for t in mem.store.triggers.values() if t.owner == consumer.me) <= 10


async def test_consumers_of_different_queue_sets_do_not_rebalance_against_each_other(
    mem: InMemory,
) -> None:
    other = "team-b"
    mem.broker.declare(other)
    a = Consumer(fast_settings(queues=[QUEUE, other]), mem.store, mem.transport())
    b = Consumer(fast_settings(queues=[other]), mem.store, mem.transport())
    async with running(a), mem.client(fast_settings()) as client:
        await client.defer_many([_far(i) for i in range(100)])  # only a serves team-a
        await until(lambda: len(a.runner) == 100)
        async with running(b):
            await asyncio.sleep(1.0)  # ten renewals each
            assert len(a.runner) == 100 and len(b.runner) == 0
    # Never shed and claimed back: each trigger was claimed once.
    assert all(t.attempt == 1 for t in mem.store.triggers.values())


async def test_a_trigger_no_live_consumer_can_load_is_failed_naming_the_class(
    mem: InMemory,
) -> None:
    from triggerflow.store import ProcessKind
    from triggerflow.writer import Writer

    s = fast_settings()
    consumer, writer = Consumer(s, mem.store, mem.transport()), Writer(s, mem.store, mem.transport())
    # A peer that might load it (newer code, say) is registered: the consumer refuses the
    # class and passes it on.
    peer = await mem.store.register(ProcessKind.CONSUMER, "h", 9, [QUEUE], 10, "v", ttl=3600)
    async with running(consumer, writer):
        await until(lambda: bool(consumer.me))
        tid = await _defer_raw(mem, 1, "tests.no_such_module.Gone", {})
        await until(lambda: consumer.me in mem.store.triggers[tid].rejected_by)
        await mem.store.unregister(peer)  # now no live consumer can load it
        await until(lambda: mem.store.task(key(1)).state == TaskState.SCHEDULED, timeout=5)
    task = mem.store.task(key(1))
    assert tid not in mem.store.triggers
    assert task.next_method == "__fail__"
    assert "tests.no_such_module.Gone" in task.next_kwargs["message"]


# ----------------------------------------------------------------------------- bounded memory


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_rss_stays_flat_over_200k_short_coroutine_triggers() -> None:
    """200,000 coroutine triggers with the 7-day default timeout, 100 at a time, through the
    runner and the consumer's reconciliation bookkeeping: RSS at the end within 10 % of RSS
    after the first 10,000."""
    import gc

    from triggerflow.consumer.reconcile import Reconciler

    reconciler = Reconciler(MemoryStore(), lambda: 1, lambda i: False, _no_republish, after=60)
    left = 0
    batch_done = asyncio.Event()

    def emit(held: Held, kind: EventKind, payload: Any) -> None:
        nonlocal left
        reconciler.fired([held.id], [held.attempt])
        left -= 1
        if left == 0:
            batch_done.set()

    runner = TriggerRunner(emit)
    after_10k = 0
    for batch in range(2000):
        left = 100
        batch_done.clear()
        for i in range(100):
            runner.start(_held(batch * 100 + i), _Quick())
        await batch_done.wait()
        if batch == 99:
            gc.collect()
            after_10k = _rss_kib()
    await asyncio.sleep(0)
    gc.collect()
    end = _rss_kib()
    assert not runner.running
    assert end <= after_10k * 1.10, f"RSS grew from {after_10k} KiB to {end} KiB"


async def _no_republish(refs: Sequence[Any]) -> None:
    return None


async def test_claimed_triggers_start_even_when_the_overflow_republish_fails(
    mem: InMemory,
) -> None:
    from triggerflow.transport.memory import MemoryTransport

    class FailsOnce(MemoryTransport):
        failed = False

        async def publish_wakeups(self, ids_by_queue: Any, **kwargs: Any) -> None:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                from triggerflow.transport import TransportUnavailable

                raise TransportUnavailable("channel closed")
            await super().publish_wakeups(ids_by_queue, **kwargs)

    s = fast_settings(capacity=5, unclaimed_grace=60)
    consumer = Consumer(s, mem.store, FailsOnce(mem.broker))
    async with running(consumer), mem.client(s) as client:
        ids = await client.defer_many([_far(i) for i in range(10)])  # one wake-up of 10
        await until(lambda: FailsOnce.failed and len(consumer.runner) == 5)
        await asyncio.sleep(0.3)
        owned = {i for i in ids if mem.store.triggers[i].owner == consumer.me}
        assert owned == set(consumer.runner.running), "claimed rows that nobody runs"
        # The overflow was not lost: its wake-up went back to the queue.
        assert sum(len(decode_wakeup(m.body)) for m in mem.broker.ready(QUEUE)) + len(
            consumer.transport._unacked) >= 1  # type: ignore[attr-defined]


async def test_the_memory_store_takes_over_as_the_postgres_one_does() -> None:
    """Mirror of test_stuck_faults.py's take-over test on the fake the loop tests use."""
    from triggerflow.store import ProcessKind, Taker
    from triggerflow.testing import ManualClock

    clock = ManualClock()
    mem = InMemory.with_clock(clock)
    mem.broker.declare(QUEUE)
    async with mem.client(fast_settings()) as client:
        mine = await client.defer_many([_far(i) for i in range(6)])
    store = mem.store
    dead = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=1)
    assert len((await store.claim(dead, mine, [QUEUE])).claimed) == 6
    peer = await store.register(ProcessKind.CONSUMER, "h", 2, [QUEUE], 10, "v", ttl=1)
    store.triggers[mine[0]].rejected_by.add(peer)
    store.triggers[mine[1]].failures = 1
    clock.advance(0.6)
    await store.renew(peer, 1, 0, [QUEUE])
    clock.advance(0.6)
    reaped = await store.reap_dead([QUEUE], 30, None, Taker(peer, room=3))
    assert [t.id for t in reaped.taken] == mine[2:5]
    assert {t.attempt for t in reaped.taken} == {2}
    assert sorted(f.id for f in reaped.freed) == sorted([mine[0], mine[1], mine[5]])
    assert [store.triggers[i].owner for i in mine] == [None, None, peer, peer, peer, None]
    assert store.triggers[mine[1]].failures == 2
