"""Fast tests of the pure parts: wire format, allow-list, loader, timer heap, settings."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.triggers import EventAfter, Raises, WaitsForever
from triggerflow.codec import KwargsCodec
from triggerflow.loader import BadKwargs, Disallowed, TriggerLoader, Unloadable
from triggerflow.model import EventKind, is_allowed
from triggerflow.runner import Held, TriggerRunner
from triggerflow.settings import Settings
from triggerflow.store import KwargsError, KwargsProblem, TriggerSpec
from triggerflow.triggers import DateTimeTrigger, TimeDeltaTrigger
from triggerflow.triggers.base import BaseTrigger, TimerTrigger, TriggerEvent
from triggerflow.wire import (
    EVENT_KINDS,
    EVENT_OVERHEAD,
    MAX_ID_MESSAGE_BYTES,
    MAX_IDS,
    Event,
    PayloadError,
    WireError,
    decode_control,
    decode_events,
    decode_wakeup,
    encode_events,
    encode_wakeup,
    event_size_bound,
    split_by_size,
    validate_payload,
)


def test_wire_roundtrip_and_versions() -> None:
    ev = Event(1, 2, "team-ml", "resume", '{"a": 1}', 1.5, "00-abc-def-01")
    assert decode_events(encode_events([ev])) == [ev]
    assert decode_wakeup(b'{"v": 1, "id": 7}') == [7]  # the previous version still reads
    for bad in (b"\xff\x00", b'{"v": 3, "ids": [1]}', b'{"v": 2, "ids": []}', b"[]"):
        with pytest.raises(WireError):
            decode_wakeup(bad)


def test_payload_validation_refuses_what_jsonb_would() -> None:
    assert validate_payload({"when": datetime(2026, 1, 1, tzinfo=UTC)}, 1000)
    with pytest.raises(PayloadError, match="NUL"):
        validate_payload("a\x00b", 1000)
    with pytest.raises(PayloadError, match="bytes"):
        validate_payload("x" * 2000, 1000)
    with pytest.raises(PayloadError, match="serializable"):
        validate_payload(object(), 1000)
    assert validate_payload("ab", 4) == '"ab"'  # exactly at the cap
    with pytest.raises(PayloadError, match=r"^event payload contains a NUL character, which jsonb"):
        validate_payload("a\x00b", 1000)
    # The reason shows 20 characters either side of the bad one.
    with pytest.raises(PayloadError) as bad:
        validate_payload("x" * 30 + "\udcff" + "y" * 30, 1000)
    assert str(bad.value).endswith("surrogates not allowed at position 30 of "
                                   "'" + "x" * 20 + "\\udcff" + "y" * 20 + "'")
    with pytest.raises(PayloadError) as bad:  # near the start: from the first character
        validate_payload("x" * 5 + "\udcff", 1000)
    assert str(bad.value).endswith("at position 5 of 'xxxxx\\udcff'")


def test_events_are_cut_into_messages_by_their_size_bound() -> None:
    ev = [Event(i, 1, "q1", "resume", "ab", 0.0, "tp") for i in range(4)]
    assert [event_size_bound(e) for e in (ev[0], Event(1, 1, "q1", "resume", "ab", 0.0))] == [
        EVENT_OVERHEAD + 4 * 2 + 2 + 2, EVENT_OVERHEAD + 4 * 2 + 2]
    bound = event_size_bound(ev[0])
    assert split_by_size(ev, 2 * bound) == [ev[:2], ev[2:]]  # two fit exactly
    assert split_by_size(ev, 2 * bound - 1) == [[e] for e in ev]
    assert split_by_size(ev[:1], 10) == [ev[:1]]  # one too big still goes, alone
    assert split_by_size([], 10) == [[]]
    # the whole list's bound decides a single part at once: exactly at the cap, one message
    assert split_by_size(ev, 4 * bound) == [ev]
    assert split_by_size(ev, 4 * bound - 1) == [ev[:3], ev[3:]]


async def test_many_events_go_out_in_messages_of_event_batch() -> None:
    """``EventSink.add_many`` (a burst's group at once, or one event) publishes full
    messages of ``event_batch`` as the buffer fills, the rest after the linger."""
    from triggerflow.emitter import EventSink

    published: list[list[int]] = []

    class Transport:
        async def publish_events(self, queue: str, events: list[Event]) -> None:
            published.append([e.trigger_id for e in events])

    sink = EventSink(Transport(), Settings(event_batch=3, event_linger=timedelta(seconds=0.05)))  # type: ignore[arg-type]
    ev = [Event(i, 1, "q", "resume", "{}", 0.0) for i in range(9)]
    sink.add_many(ev[:1])
    sink.add_many(ev[1:8])  # fills the first message, one more, and leaves 2 for the linger
    await asyncio.sleep(0)
    assert published == [[0, 1, 2], [3, 4, 5]]
    await sink.drain(1.0)
    assert published == [[0, 1, 2], [3, 4, 5], [6, 7]]
    sink.add_many(ev[8:])
    sink.add_many([])
    await sink.drain(1.0)
    assert published[-1] == [8] and sink.pending == 0


def test_wire_bounds_hold_at_the_bound_and_reasons_name_what_broke() -> None:
    ids = b'{"v": 2, "ids": [1]}'
    at_bound = ids + b" " * (MAX_ID_MESSAGE_BYTES - len(ids))
    assert decode_wakeup(at_bound) == [1]
    with pytest.raises(WireError, match=rf"^oversized wake-up: {MAX_ID_MESSAGE_BYTES + 1} bytes, "):
        decode_wakeup(at_bound + b" ")
    assert len(decode_wakeup(encode_wakeup(list(range(MAX_IDS))))) == MAX_IDS
    with pytest.raises(WireError, match=rf"^oversized wake-up: {MAX_IDS + 1} ids, over the "):
        decode_wakeup(encode_wakeup(list(range(MAX_IDS + 1))))
    for body, reason in ((b'{"v": 2, "ids": []}', "wake-up names no trigger"),
                         (b'{"v": 3, "ids": [1]}', "unsupported schema version 3; accepted [1, 2]")):
        with pytest.raises(WireError) as bad:
            decode_wakeup(body)
        assert str(bad.value) == reason
    with pytest.raises(WireError, match=r"^undecodable wake-up: "):
        decode_wakeup(b"junk")
    with pytest.raises(WireError, match=r"^undecodable event batch: "):
        decode_events(b"junk")
    every_kind = [Event(i, 1, "q", kind, "1", 0.0) for i, kind in enumerate(sorted(EVENT_KINDS))]
    assert decode_events(encode_events(every_kind)) == every_kind
    with pytest.raises(WireError) as bad:
        decode_events(encode_events([every_kind[0], Event(9, 1, "q", "bogus", "1", 0.0)]))
    assert str(bad.value) == "undecodable event batch: unknown event kind 'bogus' - at `$.events[1]`"


def test_a_bad_control_message_is_named_in_its_reason() -> None:
    with pytest.raises(WireError, match=r"^undecodable control message: "):
        decode_control(b"junk")


@pytest.mark.parametrize(("classpath", "ok"), [
    ("triggerflow.triggers.temporal.DateTimeTrigger", True),
    ("triggerflow.triggers.DateTimeTrigger", True),
    ("triggerflow.triggersevil.X", False),
    ("os.system", False),
    ("triggerflow", False),
    ("triggerflow.triggers.x.1bad", False),
])
def test_allow_list_is_checked_at_a_dot_boundary(classpath: str, ok: bool) -> None:
    assert is_allowed(classpath, ["triggerflow.triggers"]) is ok


def spec(classpath: str, kwargs: dict[str, object] | None = None,
         error: KwargsError | None = None) -> TriggerSpec:
    return TriggerSpec(1, 1, "q", classpath, {} if kwargs is None and error is None else kwargs,
                       error)


def test_loader_refuses_before_importing() -> None:
    loader = TriggerLoader(["tests"])
    sys.modules.pop("shelve", None)
    with pytest.raises(Disallowed):
        loader.build(spec("shelve.Shelf"))
    assert "shelve" not in sys.modules  # never imported
    with pytest.raises(Unloadable):
        loader.build(spec("tests.nowhere.Trigger"))
    with pytest.raises(Disallowed, match="not a BaseTrigger"):
        loader.build(spec("tests.triggers.NotATrigger"))
    with pytest.raises(BadKwargs, match="EventAfter"):
        loader.build(spec("tests.triggers.EventAfter",
                          error=KwargsError(KwargsProblem.INVALID, "not an object")))
    with pytest.raises(Unloadable, match="decrypt"):  # another consumer may hold the key
        loader.build(spec("tests.triggers.EventAfter",
                          error=KwargsError(KwargsProblem.UNREADABLE_HERE, "no key")))


def test_kwargs_codec_encrypts_and_reads_plain() -> None:
    from cryptography.fernet import Fernet

    codec = KwargsCodec(Fernet.generate_key().decode())
    token = codec.encode({"password": "hunter2"})
    assert token.startswith("fernet:") and "hunter2" not in token
    assert codec.decode(token) == {"password": "hunter2"}
    assert codec.decode('{"plain": 1}') == {"plain": 1}  # a key can be added later


def test_datetime_trigger_needs_an_aware_moment() -> None:
    with pytest.raises(ValueError, match="timezone"):
        DateTimeTrigger("2026-01-01T00:00:00")
    t = TimeDeltaTrigger(timedelta(seconds=5))
    classpath, kwargs = t.serialize()
    assert classpath == "triggerflow.triggers.temporal.DateTimeTrigger"
    assert DateTimeTrigger(**kwargs).moment == t.moment


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIGGERFLOW_QUEUES", "team-ml, default")
    monkeypatch.setenv("TRIGGERFLOW_TEAM_USERS", '{"team-ml": "ml"}')
    s = Settings()
    assert s.queues == ["team-ml", "default"]
    assert s.team_users == {"team-ml": "ml"}
    assert "heartbeat=10" in s.amqp_dsn()
    assert "guest" not in repr(s)  # secrets stay masked


async def test_runner_fires_timers_from_one_heap_and_times_out_tasks(tmp_path: Any) -> None:
    out: list[tuple[int, EventKind, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: out.append((held.id, kind, payload)))
    soon = datetime.now(UTC) + timedelta(seconds=0.2)
    for i in range(1000):
        runner.start(Held(i, 1, "q", "c", None, None, None), DateTimeTrigger(soon))
    assert runner.current_task_count() == 0  # no coroutine per timer
    runner.start(Held(5000, 1, "q", "c", None, time.time() + 0.3, None),
                 WaitsForever(marker_dir=str(tmp_path)))
    runner.start(Held(5001, 1, "q", "c", None, None, None), EventAfter(payload=1))
    runner.start(Held(5002, 1, "q", "c", None, None, None), Raises())
    cancelled = Held(5003, 1, "q", "c", None, None, None)
    runner.start(cancelled, WaitsForever(marker_dir=str(tmp_path)))
    await asyncio.sleep(0.05)
    assert [h.id for h in runner.cancel([5003])] == [5003]
    await asyncio.sleep(0.5)
    await runner.wait_cleanups()
    kinds = {i: k for i, k, _ in out}
    assert sum(1 for i in kinds if i < 1000) == 1000
    assert kinds[5000] == EventKind.FAIL and kinds[5001] == EventKind.RESUME
    assert kinds[5002] == EventKind.FAIL and 5003 not in kinds
    assert (tmp_path / "cleanup-5000").exists() and (tmp_path / "cleanup-5003").exists()
    assert len(runner) == 0


async def test_runner_fires_a_big_instant_in_slices() -> None:
    """5,000 timers due at once fire over several loop passes: a callback queued meanwhile
    (a lease renewal, a publish) runs between slices, not after the last one."""
    fired: list[int] = []
    seen_by_callback: list[int] = []
    loop = asyncio.get_running_loop()

    def emit(held: Held, kind: EventKind, payload: Any) -> None:
        if not fired:
            loop.call_soon(lambda: seen_by_callback.append(len(fired)))
        fired.append(held.id)

    runner = TriggerRunner(emit)
    past = datetime.now(UTC) - timedelta(seconds=1)
    for i in range(5000):
        runner.start(Held(i, 1, "q", "c", None, None, None), DateTimeTrigger(past))
    for _ in range(100):
        if len(fired) == 5000:
            break
        await asyncio.sleep(0)
    assert len(fired) == 5000
    assert seen_by_callback and 0 < seen_by_callback[0] < 5000


async def test_runner_emits_the_timers_of_one_instant_together() -> None:
    """A burst is built and stamped once per (class, instant), not once per timer; if that
    batch emit raises, every timer still gets its own event, one at a time."""
    groups: list[tuple[list[int], Any]] = []
    singles: list[tuple[int, EventKind]] = []
    broken = False

    def emit_many(helds: list[Held], kind: EventKind, payload: Any) -> None:
        if broken:
            raise RuntimeError("a bug in the batch path")
        groups.append(([h.id for h in helds], payload))

    runner = TriggerRunner(lambda held, kind, payload: singles.append((held.id, kind)),
                           emit_many)
    now = datetime.now(UTC)
    first, second = now - timedelta(seconds=2), now - timedelta(seconds=1)
    for i in range(600):
        runner.start(Held(i, 1, "q", "c", None, None, None),
                     DateTimeTrigger(first if i % 2 else second))
    for _ in range(100):
        if sum(len(ids) for ids, _ in groups) == 600:
            break
        await asyncio.sleep(0)
    assert sorted(len(ids) for ids, _ in groups) == [300, 300] and not singles
    assert {payload for _, payload in groups} == {first, second}  # the instants themselves
    broken = True
    for i in range(1000, 1100):
        runner.start(Held(i, 1, "q", "c", None, None, None), DateTimeTrigger(first))
    for _ in range(100):
        if len(singles) == 100:
            break
        await asyncio.sleep(0)
    assert sorted(i for i, _ in singles) == list(range(1000, 1100))
    assert {k for _, k in singles} == {EventKind.RESUME} and len(runner) == 0


class _PayloadBreaksAtFire(TimerTrigger):
    """A timer whose event builds at start (so it is accepted) and raises when it fires."""

    broken = False

    def __init__(self, moment: float) -> None:
        super().__init__()
        self.moment = moment

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_units._PayloadBreaksAtFire", {"moment": self.moment})

    def deadline(self) -> float:
        return self.moment

    async def run(self) -> AsyncIterator[TriggerEvent]:  # never called: it waits on the heap
        yield TriggerEvent(None)

    @classmethod
    def timer_payload(cls, deadline: float) -> Any:
        if cls.broken:
            raise ValueError("payload exploded")
        return deadline


async def test_timer_whose_payload_raises_at_fire_time_fails_alone() -> None:
    """The bad group fails its own tasks; the other timers of the same instant, and later
    ones, still fire (the heap is re-armed whatever one group did)."""
    fired: dict[int, tuple[EventKind, Any]] = {}
    runner = TriggerRunner(lambda held, kind, payload: fired.__setitem__(held.id, (kind, payload)))
    now = time.time()
    instant, later = now + 0.05, now + 0.15
    runner.start(Held(1, 1, "q", "c", None, None, None), _PayloadBreaksAtFire(instant))
    runner.start(Held(2, 1, "q", "c", None, None, None),
                 DateTimeTrigger(datetime.fromtimestamp(instant, UTC)))
    runner.start(Held(3, 1, "q", "c", None, None, None),
                 DateTimeTrigger(datetime.fromtimestamp(later, UTC)))
    _PayloadBreaksAtFire.broken = True
    try:
        for _ in range(100):
            if len(fired) == 3:
                break
            await asyncio.sleep(0.01)
    finally:
        _PayloadBreaksAtFire.broken = False
    assert fired[1][0] == EventKind.FAIL and "payload exploded" in str(fired[1][1])
    assert fired[2][0] == fired[3][0] == EventKind.RESUME and len(runner) == 0


class _UsesCurrentTask(BaseTrigger):
    """What Airflow triggers built on aiohttp need: a current task, asyncio.timeout()."""

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_units._UsesCurrentTask", {})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async with asyncio.timeout(5):
            await asyncio.sleep(0.01)
        yield TriggerEvent(asyncio.current_task() is not None)


async def test_runner_trigger_tasks_are_tasks_kept_by_the_runner() -> None:
    out: list[tuple[int, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: out.append((held.id, payload)))
    runner.start(Held(1, 1, "q", "c", None, None, None), _UsesCurrentTask())
    task = runner.running[1].task
    assert task is not None and task not in asyncio.all_tasks()  # held.task keeps it
    for _ in range(100):
        if out:
            break
        await asyncio.sleep(0.01)
    assert out == [(1, True)]
    await runner.wait_cleanups()


def test_payload_with_undecodable_file_name_is_a_payload_error() -> None:
    import os

    from triggerflow.wire import PayloadError, validate_payload

    with pytest.raises(PayloadError, match="not valid UTF-8"):
        validate_payload({"path": os.fsdecode(b"/data/report-\xff.csv")}, 1 << 20)


def test_kwargs_keys_per_queue_and_rotation() -> None:
    from cryptography.fernet import Fernet, InvalidToken

    from triggerflow.codec import KwargsCodec, MissingKey

    old, new, other = (Fernet.generate_key().decode() for _ in range(3))
    before = KwargsCodec(queue_keys={"team-a": old}).encode({"x": 1}, "team-a")
    rotated = KwargsCodec(queue_keys={"team-a": f"{new},{old}", "team-b": other})
    assert rotated.decode(before, "team-a") == {"x": 1}  # rows written with the old key
    after = rotated.encode({"x": 2}, "team-a")
    assert Fernet(new.encode()).decrypt(after.removeprefix("fernet:").encode()) == b'{"x":2}'
    with pytest.raises(InvalidToken):  # team b's key opens nothing of team a
        KwargsCodec(queue_keys={"team-a": other}).decode(after, "team-a")
    with pytest.raises(MissingKey):  # a consumer of b holds no key of a
        KwargsCodec(queue_keys={"team-b": other}).decode(after, "team-a")


def test_only_an_airflow_writer_is_scoped_by_queues() -> None:
    """``writer --airflow --queue Q`` scopes wake-ups and the backstop to triggerflow's queues
    during a migration; a native writer serves every queue whatever ``queues`` says (an
    environment shared by all processes may set it)."""
    from triggerflow.modes import mode_for
    from triggerflow.testing import InMemory
    from triggerflow.writer import Writer

    mem = InMemory()
    for settings, scope in ((Settings(queues=["team-a"]), None),
                            (Settings(queues=["team-a"], airflow=True), ["team-a"])):
        mode = mode_for(settings)
        writer = Writer(settings, mem.store, mem.transport(), reaper_queues=mode.writer_queues)
        assert writer.reaper.queues == scope, mode.name


def test_every_error_triggerflow_raises_has_one_root() -> None:
    """``except TriggerflowError`` catches the store's, the transport's and configuration
    errors; each keeps its old built-in base, so older ``except`` clauses still match."""
    from triggerflow.airflow.setup import UnknownAirflowSchema
    from triggerflow.cli.failures import ConfigError
    from triggerflow.codec import MissingKey
    from triggerflow.errors import ConfigurationError, TriggerflowError
    from triggerflow.lease import LeaseLost
    from triggerflow.sdk import DeferralError
    from triggerflow.store import EventRefused, EventsLocked, StoreAccessRefused, StoreError, StoreUnavailable
    from triggerflow.transport import (
        AccessRefused,
        PublishRefused,
        SubscribeRefused,
        TransportError,
        TransportUnavailable,
        Unroutable,
    )
    from triggerflow.transport.management import ManagementUnavailable
    from triggerflow.transport.subscriptions import ConnectionLost
    from triggerflow.wire import PayloadError, WireError

    store = (StoreUnavailable, StoreAccessRefused, EventRefused, EventsLocked)
    transport = (TransportUnavailable, AccessRefused, Unroutable, PublishRefused,
                 SubscribeRefused)
    assert all(issubclass(e, StoreError) for e in store)
    assert all(issubclass(e, TransportError) for e in transport)
    for error in (StoreError, TransportError, ConfigurationError, ManagementUnavailable,
                  ConnectionLost, LeaseLost, Disallowed, Unloadable, BadKwargs, WireError,
                  PayloadError, DeferralError):
        assert issubclass(error, TriggerflowError), error
    for config in (MissingKey, ConfigError, UnknownAirflowSchema):
        assert issubclass(config, ConfigurationError), config
    for kept, old_base in ((MissingKey, ValueError), (WireError, ValueError),
                           (PayloadError, ValueError), (DeferralError, ValueError),
                           (TransportUnavailable, ConnectionError)):
        assert issubclass(kept, old_base), kept
    with pytest.raises(TriggerflowError):  # a configuration error from the codec, caught
        KwargsCodec().decode("fernet:gAAAA", "team-a")
