"""Fast in-process tests of the consumer's and writer's decisions, on the in-memory store and
transport (``triggerflow.testing``). The loops are the real ones; what only real services
show (SQL, RabbitMQ's own behaviour, restarts) stays in the other test modules."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta

import pytest

from triggerflow.balance import excess, uneven
from triggerflow.consumer import Consumer
from triggerflow.model import EventKind, TaskKey, TaskState
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store import Applied, ClaimResult, ProcessKind, StoreError, StoreUnavailable
from triggerflow.testing import InMemory, ManualClock, MemoryStore, MemoryTransport
from triggerflow.triggers import DateTimeTrigger, TimeDeltaTrigger
from triggerflow.wire import EVENT_KINDS, Event, WireError, decode_events, decode_wakeup, encode_events
from triggerflow.writer import Writer

QUEUE = "team-a"


def fast_settings(**overrides: object) -> Settings:
    values: dict[str, object] = dict(
        queues=[QUEUE], allowed_modules=["triggerflow.triggers", "tests"], lease_ttl=2.0,
        renew_interval=0.1, reaper_interval=0.2, cancel_sweep_interval=0.2,
        subscription_check_interval=0.2, probation_seconds=0.1, unclaimed_grace=0.3,
        event_linger=0.001)
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - polls state the loops change
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def running(*parts: Consumer | Writer) -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(p.run(stop)) for p in parts]
    try:
        yield
    finally:
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=15)
        if pending:  # name what hangs before failing
            for t in asyncio.all_tasks():
                t.print_stack(limit=3)
        assert not pending, "a loop did not stop within 15 s"
        assert [t.result() for t in tasks] == [0] * len(parts)


def key(i: int) -> TaskKey:
    return TaskKey("dag", f"t{i}", "run")


def far() -> DateTimeTrigger:
    return TimeDeltaTrigger(timedelta(hours=1))


@pytest.fixture
def mem() -> InMemory:
    m = InMemory()
    m.broker.declare(QUEUE)
    return m


# ----------------------------------------------------------------------------- end to end


async def test_timer_fires_and_writer_schedules_the_task(mem: InMemory) -> None:
    s = fast_settings()
    consumer, writer = Consumer(s, mem.store, mem.transport()), Writer(s, mem.store, mem.transport())
    async with running(consumer, writer), mem.client(s) as client:
        await client.defer(key(1), TimeDeltaTrigger(timedelta(seconds=0.05)), queue=QUEUE,
                           kwargs={"x": 1})
        await until(lambda: mem.store.task(key(1)).state == TaskState.SCHEDULED)
    task = mem.store.task(key(1))
    assert task.next_method == "execute_complete"
    assert task.next_kwargs["x"] == 1 and str(task.next_kwargs["event"]).startswith("20")
    assert not mem.store.triggers


# ----------------------------------------------------------------------------- ack after commit


class GatedStore(MemoryStore):
    """Claims wait for ``gate``; the first ``failures`` claims fail as a lost database."""

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.failures = failures

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        await self.gate.wait()
        if self.failures:
            self.failures -= 1
            raise StoreUnavailable("connection reset")
        return await super().claim(me, ids, queues)


async def test_wakeup_is_acked_only_after_the_claim_committed() -> None:
    mem = InMemory(GatedStore())
    mem.broker.declare(QUEUE)
    store = mem.store
    assert isinstance(store, GatedStore)
    transport = mem.transport()
    consumer = Consumer(fast_settings(), store, transport)
    async with running(consumer), mem.client(fast_settings()) as client:
        [tid] = await client.defer_many([_deferral(1)])
        await until(lambda: len(transport._unacked) == 1)  # delivered, claim in flight
        await asyncio.sleep(0.1)
        assert len(transport._unacked) == 1, "acked before the claim committed"
        store.gate.set()
        await until(lambda: not transport._unacked)
        assert store.triggers[tid].owner == consumer.me
        assert tid in consumer.runner.running


class ReplyLostStore(MemoryStore):
    """The first ``lost`` claims commit, then fail as a connection cut before the reply."""

    def __init__(self, lost: int) -> None:
        super().__init__()
        self.lost = lost

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        found = await super().claim(me, ids, queues)
        if self.lost and found.claimed:
            self.lost -= 1
            raise StoreUnavailable("connection lost after the claim committed")
        return found


async def test_a_claim_that_committed_but_lost_its_reply_still_runs_its_triggers() -> None:
    store = ReplyLostStore(lost=1)
    mem = InMemory(store)
    mem.broker.declare(QUEUE)
    consumer = Consumer(fast_settings(), store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        ids = await client.defer_many([_deferral(i) for i in range(3)])
        await until(lambda: all(i in consumer.runner.running for i in ids))
        assert store.lost == 0  # the fault happened: the first claim's reply was lost
        assert consumer.doubts.freed == 3  # handed back by the doubt, then claimed again
        assert all(store.triggers[i].owner == consumer.me and store.triggers[i].attempt == 2
                   for i in ids)


def _deferral(i: int) -> object:
    from triggerflow.sdk import Deferral

    return Deferral(key(i), far(), QUEUE)


# ----------------------------------------------------------------------------- fencing


async def test_store_fences_events_of_a_stale_attempt() -> None:
    clock = ManualClock()
    mem = InMemory.with_clock(clock)
    mem.broker.declare(QUEUE)
    async with mem.client(fast_settings()) as client:
        [tid] = await client.defer_many([_deferral(1)])
    store = mem.store
    a = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=1)
    assert [s.attempt for s in (await store.claim(a, [tid], [QUEUE])).claimed] == [1]
    b = await store.register(ProcessKind.CONSUMER, "h", 2, [QUEUE], 10, "v", ttl=100)
    assert not (await store.claim(b, [tid], [QUEUE])).claimed  # a's lease is alive
    clock.advance(2)
    assert (await store.reap_dead([QUEUE], 30)).dead_owners == 1
    assert [s.attempt for s in (await store.claim(b, [tid], [QUEUE])).claimed] == [2]
    stale = Event(tid, 1, QUEUE, "resume", '{"from": "a"}', clock())
    assert await store.apply_events([stale]) == []
    assert store.task(key(1)).state == TaskState.DEFERRED
    wrong_queue = Event(tid, 2, "other", "resume", "{}", clock())
    assert await store.apply_events([wrong_queue]) == []
    current = Event(tid, 2, QUEUE, "resume", '{"from": "b"}', clock())
    assert len(await store.apply_events([current, current])) == 1  # duplicates: once
    assert store.task(key(1)).next_kwargs["event"] == {"from": "b"}


async def test_consumer_whose_lease_expired_stops_its_triggers_and_reregisters(
    mem: InMemory,
) -> None:
    consumer = Consumer(fast_settings(), mem.store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        await client.defer_many([_deferral(i) for i in range(3)])
        await until(lambda: len(consumer.runner) == 3)
        old = consumer.me
        mem.store.processes[old].expires_at = 0  # a peer declared us dead
        await until(lambda: consumer.me != old)
        # Fenced: it stopped what it held; the reaper freed the rows of the dead id and the
        # new id claimed them again, one attempt later (events of attempt 1 are now stale).
        await until(lambda: all(t.owner == consumer.me and t.attempt == 2
                                for t in mem.store.triggers.values()))
        assert old not in mem.store.processes


# ----------------------------------------------------------------------------- probation


async def test_probation_halves_suspects_and_quarantines_the_killer() -> None:
    clock = ManualClock()
    mem = InMemory.with_clock(clock)
    mem.broker.declare(QUEUE)
    async with mem.client(fast_settings()) as client:
        ids = await client.defer_many([_deferral(i) for i in range(4)])
    store = mem.store
    killer = ids[2]
    # A peer that keeps renewing witnesses each death (else: an outage, no one to blame).
    witness = await store.register(ProcessKind.CONSUMER, "h", 2, ["other"], 10, "v", ttl=1)

    async def crash_with(claimed: Callable[[int], Awaitable[list[int]]]) -> list[int]:
        me = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=1)
        held = await claimed(me)
        for _ in range(3):
            clock.advance(0.7)
            await store.renew(witness, 1, 0, ["other"])
        await store.reap_dead([QUEUE], 30)
        return held

    async def claim_all(me: int) -> list[int]:
        return [s.id for s in (await store.claim(me, ids, [QUEUE])).claimed]

    for _ in range(2):  # two ungraceful losses with all four: all suspects now
        assert await crash_with(claim_all) == ids
    me = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=1)
    assert (await store.claim(me, ids, [QUEUE])).suspects == ids
    await store.unregister(me)

    rounds = 0
    while any(t.failures >= 2 and not t.quarantined for t in store.triggers.values()):
        rounds += 1

        async def probation(me: int) -> list[int]:
            group = [s.id for s in await store.claim_probation(me, [QUEUE])]
            if killer not in group:  # innocents survive their probation
                await store.clear_probation(me, group)
                await store.release(me, group)
                return group
            return group

        group = await crash_with(probation)
        assert len(group) <= 2
        assert rounds < 10
    assert store.triggers[killer].quarantined
    assert all(store.triggers[i].failures == 0 for i in ids if i != killer)
    task = store.task(key(2))
    assert task.state == TaskState.SCHEDULED and task.next_method == "__fail__"
    assert task.next_kwargs["error"] == "Trigger quarantined"
    assert task.next_kwargs["deferred_next_method"] == "execute_complete"


async def test_consumer_runs_suspects_on_probation_and_clears_them(mem: InMemory) -> None:
    async with mem.client(fast_settings()) as client:
        ids = await client.defer_many([_deferral(i) for i in range(4)])
    for t in mem.store.triggers.values():
        t.failures = 2
    consumer = Consumer(fast_settings(), mem.store, mem.transport())
    async with running(consumer):
        await mem.transport().connect()
        transport = mem.transport()
        await transport.connect()
        await transport.publish_wakeups({QUEUE: ids})
        await until(lambda: all(t.failures == 0 for t in mem.store.triggers.values()))
        await until(lambda: len(consumer.runner) == 4)


# ----------------------------------------------------------------------------- writer


async def test_writer_bisects_a_refused_batch_and_dead_letters_only_the_bad_event(
    mem: InMemory,
) -> None:
    s = fast_settings()
    async with mem.client(s) as client:
        ids = await client.defer_many([_deferral(i) for i in range(8)])
    me = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=60)
    await mem.store.claim(me, ids, [QUEUE])
    bad = ids[5]
    events = [Event(i, 1, QUEUE, "resume", "not json" if i == bad else f'{{"n": {i}}}', 0.0)
              for i in ids]
    producer = mem.transport()
    await producer.connect()
    writer_transport = mem.transport()
    writer = Writer(s, mem.store, writer_transport)
    async with running(writer):
        await producer.publish_events(QUEUE, events)
        await until(lambda: mem.store.task(key(5)).state == TaskState.SCHEDULED)
        await until(lambda: not writer_transport._unacked)
    for i in range(8):
        task = mem.store.task(key(i))
        assert task.state == TaskState.SCHEDULED
        if i == 5:
            assert task.next_method == "__fail__"
            assert "event dead-lettered" in task.next_kwargs["message"]
        else:
            assert task.next_kwargs["event"] == {"n": ids[i]}
    [dead] = mem.broker.dead
    assert dead.reason is not None and dead.reason.startswith("database refused event")
    assert dead.body == encode_events([events[5]])
    assert writer.applied_total == 8


async def test_writer_applies_two_batches_at_once_and_acks_each(
    mem: InMemory, monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = fast_settings(writer_batch=2, writer_concurrency=2)
    async with mem.client(s) as client:
        ids = await client.defer_many([_deferral(i) for i in range(6)])
    me = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=60)
    await mem.store.claim(me, ids, [QUEUE])
    gate = asyncio.Event()
    in_flight: list[int] = []
    apply = mem.store.apply_events

    async def held_at_the_gate(events: Sequence[Event]) -> list[Applied]:
        in_flight.append(len(events))
        await gate.wait()
        return await apply(events)

    monkeypatch.setattr(mem.store, "apply_events", held_at_the_gate)
    producer = mem.transport()
    await producer.connect()
    writer_transport = mem.transport()
    writer = Writer(s, mem.store, writer_transport)
    async with running(writer):
        for pair in (ids[0:2], ids[2:4], ids[4:6]):
            await producer.publish_events(
                QUEUE, [Event(i, 1, QUEUE, "resume", "1", 0.0) for i in pair])
        await until(lambda: len(in_flight) == 2)
        await asyncio.sleep(0.05)
        assert in_flight == [2, 2]  # two batches applying, the third waits for a slot
        assert all(mem.store.task(key(i)).state == TaskState.DEFERRED for i in range(6))
        gate.set()
        await until(lambda: not writer_transport._unacked)
    assert all(mem.store.task(key(i)).state == TaskState.SCHEDULED for i in range(6))
    assert writer.applied_total == 6


async def test_writer_dead_letters_events_forged_by_another_team(mem: InMemory) -> None:
    s = fast_settings(team_users={QUEUE: "team-a-user"})
    async with mem.client(s) as client:
        [tid] = await client.defer_many([_deferral(1)])
    me = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=60)
    await mem.store.claim(me, [tid], [QUEUE])
    intruder = mem.transport(user="team-b-user")
    await intruder.connect()
    async with running(Writer(s, mem.store, mem.transport())):
        await intruder.publish_events(QUEUE, [Event(tid, 1, QUEUE, "success", "1", 0.0)])
        await until(lambda: bool(mem.broker.dead))
    assert mem.store.task(key(1)).state == TaskState.DEFERRED
    assert mem.broker.dead[0].reason is not None and "forged" in mem.broker.dead[0].reason


async def test_writer_applies_an_event_only_under_its_own_queues_routing_key(
    mem: InMemory,
) -> None:
    """No team_users set: an event for queue B's trigger published under A's key is forged."""
    s = fast_settings()
    mem.broker.declare("team-b")
    async with mem.client(s) as client:
        [tid] = await client.defer_many([_deferral(1)])
    me = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=60)
    await mem.store.claim(me, [tid], [QUEUE])
    intruder = mem.transport()
    await intruder.connect()
    async with running(Writer(s, mem.store, mem.transport())):
        await intruder.publish_events("team-b", [Event(tid, 1, QUEUE, "success", "1", 0.0)])
        await until(lambda: bool(mem.broker.dead))
    assert mem.store.task(key(1)).state == TaskState.DEFERRED
    assert mem.broker.dead[0].reason is not None and "routing key" in mem.broker.dead[0].reason


class FlakyApplyStore(MemoryStore):
    """apply_events waits for ``gate`` and raises ``errors`` first (then commits)."""

    def __init__(self, errors: list[Exception]) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.errors = errors
        self.calls = 0

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        self.calls += 1
        await self.gate.wait()
        if self.errors:
            raise self.errors.pop(0)
        return await super().apply_events(events)


async def _writer_case(store: FlakyApplyStore) -> tuple[InMemory, list[int], Settings]:
    mem = InMemory(store)
    mem.broker.declare(QUEUE)
    s = fast_settings()
    async with mem.client(s) as client:
        ids = await client.defer_many([_deferral(i) for i in range(3)])
    me = await store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 10, "v", ttl=60)
    await store.claim(me, ids, [QUEUE])
    return mem, ids, s


async def test_writer_retries_a_batch_on_any_store_error_and_keeps_running() -> None:
    store = FlakyApplyStore([StoreError("cannot execute UPDATE in a read-only transaction"),
                             StoreError("canceling statement due to statement timeout")])
    mem, ids, s = await _writer_case(store)
    store.gate.set()
    producer = mem.transport()
    await producer.connect()
    async with running(Writer(s, mem.store, mem.transport())):
        await producer.publish_events(QUEUE, [Event(t, 1, QUEUE, "resume", "1", 0.0) for t in ids])
        await until(lambda: all(store.task(key(i)).state == TaskState.SCHEDULED
                                for i in range(3)))
    assert store.calls == 3 and not mem.broker.dead


async def test_writer_survives_losing_the_broker_between_commit_and_ack() -> None:
    store = FlakyApplyStore([])
    mem, ids, s = await _writer_case(store)
    producer = mem.transport()
    await producer.connect()
    transport = mem.transport()
    writer = Writer(s, mem.store, transport)
    async with running(writer):
        await producer.publish_events(QUEUE, [Event(t, 1, QUEUE, "resume", "1", 0.0) for t in ids])
        await until(lambda: store.calls == 1)  # the batch is in the statement
        await transport.kill()
        store.gate.set()  # it commits; its ack finds the channel gone
        await until(lambda: all(store.task(key(i)).state == TaskState.SCHEDULED
                                for i in range(3)))
        # Redelivered after the reconnect, the events match nothing and are acked.
        await until(lambda: store.calls >= 2 and not transport._unacked
                    and not mem.broker.ready("events"))
    assert writer.applied_total == 3 and not mem.broker.dead


def test_wire_event_kinds_are_the_models() -> None:
    assert {str(k) for k in EventKind} == EVENT_KINDS
    with pytest.raises(WireError, match="unknown event kind"):
        decode_events(b'{"v": 2, "events": [[1, 1, "q", "state-of-my-choice", "1", 0.0]]}')


# ----------------------------------------------------------------------------- flow control


async def test_at_capacity_the_overflow_is_republished_and_subscriptions_pause(
    mem: InMemory,
) -> None:
    s = fast_settings(capacity=5, claim_batch=100)
    transport = mem.transport()
    consumer = Consumer(s, mem.store, transport)
    async with mem.client(s) as client:
        ids = await client.defer_many([_deferral(i) for i in range(8)])
    mem.broker.queues[QUEUE].messages.clear()  # deliver them as one wake-up below
    publisher = mem.transport()
    await publisher.connect()
    async with running(consumer):
        await until(lambda: consumer.subscriptions.connected.is_set())
        await publisher.publish_wakeups({QUEUE: ids})
        await until(lambda: len(consumer.runner) == 5)
        await until(lambda: not mem.broker.queues[QUEUE].subscriptions)  # paused
        assert not transport._unacked  # the wake-up was acked, never held or nacked
        rest = [i for m in mem.broker.ready(QUEUE) for i in decode_wakeup(m.body)]
        assert sorted(rest) == ids[5:]
        assert consumer.subscriptions.paused


# ----------------------------------------------------------------------------- rebalancing


async def test_consumer_over_its_fair_share_hands_the_excess_back(mem: InMemory) -> None:
    s = fast_settings()
    transport = mem.transport()
    consumer = Consumer(s, mem.store, transport)
    async with running(consumer), mem.client(s) as client:
        await client.defer_many([_deferral(i) for i in range(100)])
        await until(lambda: len(consumer.runner) == 100)
        # A peer joined with nothing: two live consumers, 100 running in all.
        n = excess(100, 2, 100, s.reclaim_rate)
        assert n > 40  # to 110% of the share
        resent = list(consumer.runner.running)[-n:]
        consumer._maybe_rebalance(live_peers=2, peers_running=100)
        await until(lambda: bool(transport.published_wakeups))
        assert set(transport.published_wakeups[0][1]) <= set(resent)
        await until(lambda: len(consumer.runner) == 100 - n)
        # Released and re-sent through the queue (here this same consumer, the only one,
        # claims them again: one attempt later).
        await until(lambda: all(mem.store.triggers[i].attempt == 2 for i in resent))


async def test_a_shed_waits_for_the_peers_to_count_it_before_another(mem: InMemory) -> None:
    s = fast_settings(renew_interval=0.5)  # the next decision waits 3 renewals: 1.5 s
    consumer = Consumer(s, mem.store, mem.transport())
    sheds: list[int] = []
    shed = consumer._shed

    async def counting(ids: list[int]) -> None:
        sheds.append(len(ids))
        await shed(ids)

    consumer._shed = counting  # type: ignore[method-assign]
    async with running(consumer), mem.client(s) as client:
        await client.defer_many([_deferral(i) for i in range(100)])
        await until(lambda: len(consumer.runner) == 100)
        consumer._maybe_rebalance(live_peers=2, peers_running=100)
        await until(lambda: len(consumer.runner) == 56)
        # The peer claimed the 44 but has not renewed: its row still says 0, so the total
        # reads 56 and the share 28. Taken at its word this sheds 25 more.
        assert excess(56, 2, 56, s.reclaim_rate) == 25
        consumer._maybe_rebalance(live_peers=2, peers_running=56)
        await asyncio.sleep(0.1)
        assert sheds == [44]
        # Once the peers have renewed, a real excess is shed again.
        await asyncio.sleep(1.5)
        consumer._maybe_rebalance(live_peers=2, peers_running=56)
        await until(lambda: len(sheds) == 2)


async def _shed_44_of_100(consumer: Consumer, transport: MemoryTransport,
                          client: TriggerflowClient) -> list[int]:
    """100 deferred and running here, then a shed to a peer said to hold none: the ids whose
    wake-ups it handed back through the queue."""
    await client.defer_many([_deferral(i) for i in range(100)])
    await until(lambda: len(consumer.runner) == 100)
    consumer._maybe_rebalance(live_peers=2, peers_running=100)
    await until(lambda: bool(transport.published_wakeups))
    return [i for q, part in transport.published_wakeups if q == QUEUE for i in part]


async def test_wakeups_a_shed_handed_back_go_on_to_peers_for_a_while(mem: InMemory) -> None:
    s = fast_settings(renew_interval=0.5, unclaimed_grace=30.0)
    transport = mem.transport()
    consumer = Consumer(s, mem.store, transport)
    async with running(consumer), mem.client(s) as client:
        resent = await _shed_44_of_100(consumer, transport, client)
        # Delivered to this same consumer (the only one here), they are not claimed back
        # while the shed settles: passed on again, unclaimed.
        await asyncio.sleep(0.5)
        assert len(consumer.runner) == 56
        assert all(mem.store.triggers[i].attempt == 1 for i in resent)
        assert len(transport.published_wakeups) > 1
        # After it, with no peer taking them, they are claimed here.
        await until(lambda: all(mem.store.triggers[i].attempt == 2 for i in resent))
        assert len(consumer.runner) == 100


async def test_a_peer_leaving_ends_the_shed_ceiling_at_once(mem: InMemory) -> None:
    """The peer a shed handed wake-ups to closes its connection (killed, or stopped): what it
    had not claimed is claimed here at once, not bounced through the queue until the shed
    settles (15 s here; no renewal comes meanwhile to say a peer died)."""
    s = fast_settings(renew_interval=5.0, lease_ttl=15.0, unclaimed_grace=30.0)
    transport = mem.transport()
    consumer = Consumer(s, mem.store, transport)
    peer = mem.transport()  # the peer's broker connection, as presence sees it
    await peer.connect()
    assert await peer.watch_presence(lambda name: None)
    async with running(consumer), mem.client(s) as client:
        resent = await _shed_44_of_100(consumer, transport, client)
        await until(lambda: len(transport.published_wakeups) > 2)  # bounced, unclaimed
        assert len(consumer.runner) == 56 and consumer.admission.ceiling is not None
        await peer.close()
        await until(lambda: all(mem.store.triggers[i].attempt == 2 for i in resent), timeout=4.0)
        assert consumer.admission.ceiling is None
        assert len(consumer.runner) == 100


async def test_joining_beside_a_peer_waits_for_its_runtime_and_alone_does_not(
    mem: InMemory,
) -> None:
    """Airflow mode's runtime child takes seconds to start: a consumer that joins a fleet
    takes nothing until it answers (the peer runs everything meanwhile, and does not count
    the newcomer as capacity); then it takes its share."""
    s = fast_settings()
    peer = Consumer(s, mem.store, mem.transport())
    ready = asyncio.Event()
    joining = Consumer(s, mem.store, mem.transport(), warm_up=ready)
    async with running(peer), mem.client(s) as client:
        await until(lambda: peer.me in mem.store.processes and mem.store.processes[peer.me].subscribed)
        async with running(joining):
            await until(lambda: joining.admission.warming)
            ids = await client.defer_many([_deferral(i) for i in range(100)])
            await until(lambda: len(peer.runner) == 100)
            await asyncio.sleep(0.5)  # five renewals: the peer would have shed to it
            assert len(joining.runner) == 0 and len(peer.runner) == 100
            assert joining.subscriptions.paused  # no deliveries reach it
            assert not mem.store.processes[joining.me].subscribed
            ready.set()
            await until(lambda: len(joining.runner) > 0)  # the peer's shed, claimed now
            assert not joining.admission.warming
            await until(lambda: len(joining.runner) + len(peer.runner) == 100)
            assert set(joining.runner.running) | set(peer.runner.running) == set(ids)


async def test_a_peer_leaving_ends_the_warm_up_at_once(mem: InMemory) -> None:
    """The peer that served our queues closes its connection while our runtime is still
    cold: we take triggers at once, not after its lease or our runtime (neither comes here)."""
    s = fast_settings(renew_interval=5.0, lease_ttl=60.0)
    serving = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 100, "v", ttl=60)
    await mem.store.renew(serving, 60, 0, [QUEUE], subscribed=True)
    peer = mem.transport()  # its broker connection, as presence sees it
    await peer.connect()
    assert await peer.watch_presence(lambda name: None)
    joining = Consumer(s, mem.store, mem.transport(), warm_up=asyncio.Event())  # never set
    async with running(joining):
        await until(lambda: joining.admission.warming)
        await peer.close()
        await until(lambda: not joining.admission.warming, timeout=2.0)  # no renewal meanwhile
        await until(lambda: not joining.subscriptions.paused)  # deliveries reach it again


async def test_a_peer_whose_lease_expires_ends_the_warm_up(mem: InMemory) -> None:
    """A frozen peer keeps its socket: our renewal that finds its lease expired ends the wait."""
    frozen = await mem.store.register(ProcessKind.CONSUMER, "h", 1, [QUEUE], 100, "v", ttl=1.5)
    await mem.store.renew(frozen, 1.5, 0, [QUEUE], subscribed=True)
    joining = Consumer(fast_settings(), mem.store, mem.transport(), warm_up=asyncio.Event())
    async with running(joining):
        await until(lambda: joining.admission.warming)
        await until(lambda: not joining.admission.warming, timeout=5.0)
        assert frozen not in mem.store.processes or not mem.store._alive(frozen)


async def test_a_lone_consumer_does_not_wait_for_its_runtime(mem: InMemory) -> None:
    s = fast_settings()
    alone = Consumer(s, mem.store, mem.transport(), warm_up=asyncio.Event())  # never set
    async with running(alone), mem.client(s) as client:
        ids = await client.defer_many([_deferral(i) for i in range(3)])
        await until(lambda: all(i in alone.runner.running for i in ids))
        assert not alone.admission.warming


def test_rebalance_sheds_only_real_excess() -> None:
    assert excess(mine=100, live_peers=1, peers_running=100, max_shed=1000) == 0
    assert excess(mine=60, live_peers=2, peers_running=100, max_shed=1000) == 0  # < 125%
    assert excess(mine=70, live_peers=2, peers_running=80, max_shed=1000) == 26
    assert excess(mine=20, live_peers=2, peers_running=20, max_shed=1000) == 0  # < 20 over
    assert excess(mine=1000, live_peers=2, peers_running=1000, max_shed=100) == 100
    # The bounds themselves: exactly 125% of the share sheds nothing, exactly 20 over sheds.
    assert excess(mine=500, live_peers=2, peers_running=800, max_shed=1000) == 0
    assert excess(mine=26, live_peers=2, peers_running=10, max_shed=1000) == 20


def test_store_reads_peers_often_exactly_while_a_shed_is_due() -> None:
    # The store's "uneven" (peers read on every renewal) is the consumer's "excess > 0".
    cases = [(100, 1, 100), (60, 2, 100), (70, 2, 80), (20, 2, 20), (500, 2, 800), (26, 2, 10)]
    for mine, live, held in cases:
        assert uneven(mine, live, held) == (excess(mine, live, held, max_shed=10**6) > 0)
    assert uneven(70, 2, 80) and not uneven(60, 2, 100)


# ----------------------------------------------------------------------------- cancellation


async def test_cancel_stops_the_trigger_on_its_owner(mem: InMemory) -> None:
    consumer = Consumer(fast_settings(), mem.store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        [tid] = await client.defer_many([_deferral(1)])
        await until(lambda: tid in consumer.runner.running)
        assert await client.cancel([tid]) == 1
        await until(lambda: tid not in consumer.runner.running)
        assert tid not in mem.store.triggers
    assert mem.store.task(key(1)).state == TaskState.REMOVED


async def test_sweep_cancels_what_the_control_message_missed(mem: InMemory) -> None:
    consumer = Consumer(fast_settings(), mem.store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        [tid] = await client.defer_many([_deferral(1)])
        await until(lambda: tid in consumer.runner.running)
        mem.store.task(key(1)).state = TaskState.FAILED  # marked by hand, no message sent
        await until(lambda: tid not in consumer.runner.running)
        assert tid not in mem.store.triggers


async def test_control_cancel_stops_only_what_the_store_confirms(mem: InMemory) -> None:
    """Sweep off: a cancel for a task still deferred is ignored (anyone may publish one);
    once the task left ``deferred``, the control message cancels at once."""
    s = fast_settings(cancel_sweep_interval=3600)
    consumer = Consumer(s, mem.store, mem.transport())
    async with running(consumer), mem.client(s) as client:
        [tid] = await client.defer_many([_deferral(1)])
        await until(lambda: tid in consumer.runner.running)
        intruder = mem.transport(user="team-b-user")
        await intruder.connect()
        await intruder.publish_control(consumer.me, "cancel", [tid], queue=QUEUE)
        await asyncio.sleep(0.3)
        assert tid in consumer.runner.running and tid in mem.store.triggers
        assert await client.cancel([tid]) == 1
        await until(lambda: tid not in consumer.runner.running, timeout=1)
        assert tid not in mem.store.triggers


# ----------------------------------------------------------------------------- subscriptions


async def test_a_silently_dropped_subscription_is_renewed(mem: InMemory) -> None:
    consumer = Consumer(fast_settings(), mem.store, mem.transport())
    async with running(consumer), mem.client(fast_settings()) as client:
        await until(lambda: bool(mem.broker.subscription_tags(QUEUE)))
        [tag] = mem.broker.subscription_tags(QUEUE)
        mem.broker.cancel_subscription(tag)
        [tid] = await client.defer_many([_deferral(1)])
        await until(lambda: tid in consumer.runner.running)


async def test_unreadable_wakeup_is_dead_lettered_and_acked(mem: InMemory) -> None:
    from triggerflow.transport.memory import Message

    transport = mem.transport()
    consumer = Consumer(fast_settings(), mem.store, transport)
    async with running(consumer):
        await until(lambda: bool(mem.broker.subscription_tags(QUEUE)))
        mem.broker._put(QUEUE, Message(b"not a wake-up", QUEUE))
        await until(lambda: bool(mem.broker.dead))
        await until(lambda: not transport._unacked)
    [dead] = mem.broker.dead
    assert dead.body == b"not a wake-up" and dead.reason
