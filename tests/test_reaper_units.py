"""The reaper's and probation's own decisions, in-process, on a scripted store and a recording
broker: what the reaper re-sends where, what it hands its consumer first, what a broken broker
costs, which queues it reports unconsumed, when it sweeps; when probation takes suspects.
(They kill mutants that `make mutate-py` found surviving the loop tests.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.conftest import Counted
from triggerflow.consumer.probation import Probation
from triggerflow.reaper import Reaper
from triggerflow.settings import Settings
from triggerflow.store import FreedTrigger, Reaped, StoreUnavailable, Taker, TriggerRef, TriggerSpec
from triggerflow.transport import TransportUnavailable, Unroutable


class ScriptedStore:
    """Answers each reaper query from a script and records how it was asked."""

    def __init__(self, reaped: list[Reaped] | None = None, **answers: Any) -> None:
        self.reaped = list(reaped or [])
        self.answers = answers
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def reap_dead(self, *args: Any) -> Reaped:
        self.calls.append(("reap_dead", args))
        return self.reaped.pop(0) if self.reaped else Reaped([], 0)

    def __getattr__(self, name: str) -> Any:
        async def answer(*args: Any) -> Any:
            self.calls.append((name, args))
            return self.answers[name]
        return answer


class RecordingBroker:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.published: list[tuple[dict[str, list[int]], int]] = []

    async def publish_wakeups(self, by_queue: dict[str, list[int]], rate: int) -> None:
        if self.error is not None:
            raise self.error
        self.published.append((dict(by_queue), rate))


class Room:
    """A consumer that takes ``room`` ids of each queue itself and returns the rest."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.offered: list[tuple[str, list[int]]] = []
        self.adopted: list[tuple[Taker, list[TriggerSpec]]] = []
        self.doubted: list[float] = []  # take-overs that failed and may have committed

    @contextlib.asynccontextmanager
    async def taking(self) -> AsyncIterator[Taker | None]:
        yield Taker(me=9, room=self.room)

    async def adopt(self, taker: Taker, specs: list[TriggerSpec]) -> None:
        self.adopted.append((taker, specs))

    def take_locally(self, queue: str, ids: list[int]) -> list[int]:
        self.offered.append((queue, ids))
        return ids[self.room:]

    def unanswered(self, began: float) -> None:
        self.doubted.append(began)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counted:
    metrics = Counted()
    monkeypatch.setattr("triggerflow.reaper.get_metrics", lambda: metrics)
    return metrics


def freed(id: int, queue: str, quarantined: bool = False) -> FreedTrigger:
    return FreedTrigger(id, queue, "tests.triggers.Sleep", 2 if quarantined else 0, quarantined)


def reaper(store: ScriptedStore, broker: RecordingBroker, local: Room | None = None,
           queues: tuple[str, ...] = ("a", "b"), **settings: Any) -> Reaper:
    return Reaper(store, broker, Settings(queues=list(queues), reclaim_rate=77,  # type: ignore[arg-type]
                                          **settings), local)


async def test_freed_triggers_go_to_their_own_queues_and_quarantined_ones_nowhere(
        counted: Counted) -> None:
    store = ScriptedStore([Reaped([freed(1, "a"), freed(2, "b"), freed(3, "a"),
                                   freed(4, "a", quarantined=True)], dead_owners=1)])
    broker = RecordingBroker()
    assert await reaper(store, broker, max_failures=3, reap_batch=10).reap_dead() == 4
    assert broker.published == [({"a": [1, 3], "b": [2]}, 77)]
    assert store.calls == [("reap_dead", (["a", "b"], 3, 10, None, 3))]
    assert counted.adds == [("quarantined", 1, {"queue": "a"}),
                            ("resent", 2, {"cause": "dead_owner", "queue": "a"}),
                            ("resent", 1, {"cause": "dead_owner", "queue": "b"})]


async def test_nothing_reaped_sends_and_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    broker = RecordingBroker()
    with caplog.at_level(logging.INFO, logger="triggerflow.reaper"):
        assert await reaper(ScriptedStore(), broker, Room(room=1)).reap_dead() == 0
    assert (broker.published, caplog.text) == ([], "")


async def test_what_is_only_taken_over_is_logged_and_nothing_resent(
        caplog: pytest.LogCaptureFixture) -> None:
    taken = [TriggerSpec(5, 2, "a", "tests.triggers.Sleep", {})]
    store = ScriptedStore([Reaped([], dead_owners=0, taken=taken)])
    broker = RecordingBroker()
    with caplog.at_level(logging.INFO, logger="triggerflow.reaper"):
        assert await reaper(store, broker, Room(room=1)).reap_dead() == 1
    assert "reclaimed 1 triggers (1 taken over here) of dead consumers (a batch" in caplog.text
    assert all(not by_queue for by_queue, _ in broker.published)


class ReplyLost(ScriptedStore):
    async def reap_dead(self, *args: Any) -> Reaped:
        self.calls.append(("reap_dead", args))
        raise StoreUnavailable("connection lost after the take-over committed")


async def test_a_take_over_whose_reply_was_lost_is_a_doubt() -> None:
    room = Room(room=5)
    before = asyncio.get_running_loop().time()
    with pytest.raises(StoreUnavailable):
        await reaper(ReplyLost(), RecordingBroker(), room).reap_dead()
    assert len(room.doubted) == 1 and room.doubted[0] >= before  # began before the statement
    assert room.adopted == []


async def test_a_writers_reaper_covers_every_queue_and_takes_nothing() -> None:
    store = ScriptedStore([Reaped([freed(1, "a")], dead_owners=1)])
    broker = RecordingBroker()
    assert await reaper(store, broker, queues=()).reap_dead() == 1
    assert store.calls[0][1][0] is None  # scope: all queues
    assert store.calls[0][1][3] is None  # no taker
    assert broker.published == [({"a": [1]}, 77)]


async def test_reaping_goes_on_in_batches_until_one_comes_back_short() -> None:
    full = Reaped([freed(1, "a"), freed(2, "a")], dead_owners=0)
    store = ScriptedStore([full, full, Reaped([freed(3, "b")], dead_owners=1)])
    broker = RecordingBroker()
    assert await reaper(store, broker, reap_batch=2).reap_dead() == 5
    assert [c[0] for c in store.calls] == ["reap_dead"] * 3
    assert [p for p, _ in broker.published] == [{"a": [1, 2]}, {"a": [1, 2]}, {"b": [3]}]


async def test_the_consumer_takes_freed_triggers_first_and_only_the_rest_are_resent(
        counted: Counted, caplog: pytest.LogCaptureFixture) -> None:
    taken = TriggerSpec(5, 2, "a", "tests.triggers.Sleep", {})
    store = ScriptedStore([Reaped([freed(1, "a"), freed(2, "b"), freed(3, "a")],
                                  dead_owners=1, taken=[taken])])
    broker, local = RecordingBroker(), Room(room=1)
    with caplog.at_level(logging.INFO, logger="triggerflow.reaper"):
        assert await reaper(store, broker, local, max_failures=4, reap_batch=10).reap_dead() == 4
    assert "reclaimed 4 triggers (1 taken over here) from 1 dead consumer(s)" in caplog.text
    assert local.offered == [("a", [1, 3]), ("b", [2])]
    assert broker.published == [({"a": [3]}, 77)]  # "b" had room for its one: nothing to send
    assert local.adopted == [(Taker(me=9, room=1), [taken])]
    assert store.calls[0] == ("reap_dead", (["a", "b"], 4, 10, Taker(me=9, room=1), 3))
    assert counted.adds == [("taken_over", 1, None),
                            ("resent", 1, {"cause": "dead_owner", "queue": "a"})]


@pytest.mark.parametrize(("error", "level", "words"), [
    (Unroutable("no queue bound"), logging.ERROR, "cannot re-send triggers: no queue bound"),
    (TransportUnavailable("gone"), logging.WARNING, "broker down; 2 triggers will be re-sent"),
])
async def test_a_broken_broker_costs_the_resend_not_the_sweep(
        error: Exception, level: int, words: str, caplog: pytest.LogCaptureFixture,
        counted: Counted) -> None:
    store = ScriptedStore(resend_unclaimed=[TriggerRef(1, "a"), TriggerRef(2, "b")])
    with caplog.at_level(logging.WARNING, logger="triggerflow.reaper"):
        assert await reaper(store, RecordingBroker(error)).resend_unclaimed() == 2
    assert [(r.levelno, r.getMessage()[:len(words)]) for r in caplog.records
            if r.name == "triggerflow.reaper"] == [(level, words)]
    # Counted unless the broker was down (those are re-sent later): an unroutable publish counts.
    assert len(counted.adds) == (2 if isinstance(error, Unroutable) else 0)


async def test_unclaimed_and_orphan_sweeps_pass_their_settings_and_scope(counted: Counted) -> None:
    store = ScriptedStore(resend_unclaimed=[TriggerRef(1, "b")],
                          time_out_orphans=[TriggerRef(2, "a"), TriggerRef(3, "a")])
    broker = RecordingBroker()
    sweeper = reaper(store, broker, unclaimed_grace=4.0, max_deferral=600.0)
    assert await sweeper.resend_unclaimed() == 1
    assert await sweeper.time_out_orphans() == 2
    assert store.calls == [("resend_unclaimed", (["a", "b"], 4.0, 77)),
                           ("time_out_orphans", (["a", "b"], 600.0))]
    assert broker.published == [({"b": [1]}, 77)]
    assert counted.adds == [("resent", 1, {"cause": "unclaimed", "queue": "b"}),
                            ("timed_out", 2, {"queue": "a"})]


async def test_nothing_unclaimed_sends_nothing() -> None:
    broker = RecordingBroker()
    assert await reaper(ScriptedStore(resend_unclaimed=[]), broker).resend_unclaimed() == 0
    assert broker.published == []


async def test_a_consumers_reaper_reports_its_own_queues_nobody_consumes(
        caplog: pytest.LogCaptureFixture, counted: Counted) -> None:
    store = ScriptedStore(queue_consumers={"a": 0, "b": 2})
    sweeper = reaper(store, RecordingBroker())
    with caplog.at_level(logging.WARNING, logger="triggerflow.reaper"):
        assert await sweeper.report_unconsumed() == ["a"]
    assert sweeper.unconsumed == ["a"]
    assert store.calls == [("queue_consumers", (["a", "b"],))]
    assert "queue a has no live consumer" in caplog.text
    assert counted.adds == [("unconsumed", 1, {"queue": "a"})]


async def test_a_writers_reaper_reports_the_waiting_queues_nobody_consumes() -> None:
    store = ScriptedStore(waiting_queues=["a", "c"], queue_consumers={"a": 1, "c": 0})
    sweeper = reaper(store, RecordingBroker(), queues=(), unclaimed_grace=4.0)
    sweeper.unconsumed = ["stale"]
    assert await sweeper.report_unconsumed() == ["c"]
    assert store.calls == [("waiting_queues", (4.0,)), ("queue_consumers", (["a", "c"],))]
    store.answers["waiting_queues"] = []
    assert await sweeper.report_unconsumed() == []
    assert sweeper.unconsumed == []


async def sweeps(store: ScriptedStore, connected: asyncio.Event, now: asyncio.Event,
                 **settings: Any) -> asyncio.Task[None]:
    return asyncio.create_task(reaper(store, RecordingBroker(), **settings).run(connected, now))


async def called(store: ScriptedStore, n: int) -> list[str]:
    """The first ``n`` store calls, once made."""
    async with asyncio.timeout(10):
        while len(store.calls) < n:  # noqa: ASYNC110 - polls the scripted store
            await asyncio.sleep(0.01)
    return [name for name, _ in store.calls[:n]]


async def test_a_witnessed_death_reaps_at_once_and_the_full_sweep_waits_its_interval() -> None:
    store = ScriptedStore(resend_unclaimed=[], time_out_orphans=[])
    connected, now = asyncio.Event(), asyncio.Event()
    task = await sweeps(store, connected, now, reaper_interval=60.0)
    try:
        now.set()
        await asyncio.sleep(0.05)
        assert store.calls == []  # nothing is freed while the broker is away
        connected.set()
        assert await called(store, 3) == ["reap_dead", "resend_unclaimed", "time_out_orphans"]
        now.set()  # another death: reaped now, the full sweep not again before 60 s
        assert await called(store, 4) == ["reap_dead", "resend_unclaimed", "time_out_orphans",
                                          "reap_dead"]
        await asyncio.sleep(0.05)
        assert len(store.calls) == 4
    finally:
        task.cancel()


async def test_without_a_witness_the_reaper_sweeps_every_interval() -> None:
    store = ScriptedStore(resend_unclaimed=[], time_out_orphans=[])
    connected = asyncio.Event()
    connected.set()
    task = await sweeps(store, connected, asyncio.Event(), reaper_interval=0.05)
    try:
        assert (await called(store, 6)).count("reap_dead") == 2
    finally:
        task.cancel()


# ------------------------------------------------------------------------------- probation


class Suspects(ScriptedStore):
    """claim_probation answers from a list (an exception is raised); clear_probation records."""

    def __init__(self, *groups: list[TriggerSpec] | Exception) -> None:
        super().__init__(clear_probation=None)
        self.groups = list(groups)

    async def claim_probation(self, *args: Any) -> list[TriggerSpec]:
        self.calls.append(("claim_probation", args))
        group = self.groups.pop(0) if self.groups else []
        if isinstance(group, Exception):
            raise group
        return group


class Me:
    me = 7


class Admitting:
    """The consumer's admission as probation sees it: the claim lock and the room left."""

    def __init__(self, room: list[int]) -> None:
        self.lock = asyncio.Lock()
        self.room = lambda: room[0]
        self.doubted: list[float] = []  # probation claims that failed, maybe committed
        self.unanswered = self.doubted.append


def on_probation(store: Suspects, room: list[int], started: list[int],
                 admitting: Admitting | None = None) -> asyncio.Task[None]:
    probation = Probation(store, Me(), ["a"], admitting or Admitting(room),  # type: ignore[arg-type]
                          lambda spec: started.append(spec.id), seconds=0.01)
    probation.suspects.set()
    return asyncio.create_task(probation.run())


def suspect(id: int) -> TriggerSpec:
    return TriggerSpec(id, 3, "a", "tests.triggers.Sleep", {})


async def test_a_full_consumer_takes_suspects_only_once_it_has_room() -> None:
    store, room, started = Suspects([suspect(1)]), [0], []
    task = on_probation(store, room, started)
    try:
        await asyncio.sleep(0.05)  # nothing to wait for: a full consumer claims nothing
        assert store.calls == []
        room[0] = 1
        assert await called(store, 3) == ["claim_probation", "clear_probation", "claim_probation"]
        assert store.calls[:2] == [("claim_probation", (7, ["a"], 1)),
                                   ("clear_probation", (7, [1]))]
        assert started == [1]
    finally:
        task.cancel()


async def test_a_failed_probation_claim_is_tried_again() -> None:
    store, started, admitting = Suspects(StoreUnavailable("blip"), [suspect(2)]), [], Admitting([5])
    task = on_probation(store, [5], started, admitting)
    try:
        assert await called(store, 3) == ["claim_probation", "claim_probation", "clear_probation"]
        assert started == [2]
        assert len(admitting.doubted) == 1  # the failed claim may have committed: a doubt
    finally:
        task.cancel()
