"""Airflow's trigger classes, rebuilt from rows as Airflow stores them, and its timer triggers
on triggerflow's heap: the event must be the one Airflow's own ``run()`` yields."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Any

import pendulum
import pytest

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from triggerflow.model import EventKind
from triggerflow.runner import Held, TriggerRunner

DATETIME_TRIGGER = "airflow.providers.standard.triggers.temporal.DateTimeTrigger"


def stored(trigger: Any) -> tuple[str, str]:
    """(classpath, kwargs column) exactly as Airflow writes a trigger row."""
    from airflow.models.trigger import Trigger

    row = Trigger.from_object(trigger)
    return row.classpath, row.encrypted_kwargs


def serde(value: Any) -> str:
    from airflow.sdk.serde import serialize

    return json.dumps(serialize(value), sort_keys=True)


async def airflow_event(trigger: Any) -> tuple[EventKind, str]:
    """What Airflow's own coroutine yields, as (kind, serde'd payload) for comparison."""
    from airflow.triggers.base import BaseTaskEndEvent

    event = await anext(trigger.run())
    if isinstance(event, BaseTaskEndEvent):
        return EventKind(str(event.task_instance_state)), serde(event.xcoms)
    return EventKind.RESUME, serde(event.payload)


def cases() -> list[Any]:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger, TimeDeltaTrigger

    past = datetime.datetime(2026, 11, 30, 9, 15, 7, 654321, tzinfo=datetime.UTC)
    forms = [
        DateTimeTrigger(moment=past),
        DateTimeTrigger(moment=pendulum.datetime(2026, 3, 29, 2, 30, 0, 1, tz="Europe/Paris")),
        DateTimeTrigger(moment=past, end_from_trigger=True),
        TimeDeltaTrigger(datetime.timedelta(seconds=-3.25)),
        TimeDeltaTrigger(datetime.timedelta(microseconds=-1), end_from_trigger=True),
    ]
    # ``target_time`` (provider 1.21.0 on): what start_from_trigger rows carry.
    forms += [
        DateTimeTrigger(target_time="2026-11-30T10:15:07.123456+01:00"),
        DateTimeTrigger(target_time="2026-06-01 08:00:00", end_from_trigger=True),
    ]
    return forms


@pytest.mark.parametrize("index", range(7))
async def test_timer_payload_is_what_airflow_run_yields(index: int) -> None:
    from triggerflow.airflow.kwargs import build_trigger
    from triggerflow.airflow.timers import as_timer

    classpath, kwargs = stored(cases()[index])
    assert classpath == DATETIME_TRIGGER
    theirs = await airflow_event(build_trigger(classpath, kwargs))

    timer = as_timer(build_trigger(classpath, kwargs))
    assert timer is not None
    fired: list[tuple[EventKind, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: fired.append((kind, payload)))
    runner.start(Held(1, 1, "q", classpath, None, None, None), timer)
    assert runner.running[1].task is None  # on the heap, not a coroutine
    await asyncio.sleep(0.05)
    assert len(fired) == 1
    kind, payload = fired[0]
    assert (kind, serde(payload)) == theirs


async def test_future_timer_fires_on_time_with_airflows_payload() -> None:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.kwargs import build_trigger
    from triggerflow.airflow.timers import as_timer

    moment = pendulum.now("UTC").add(seconds=0.4)
    classpath, kwargs = stored(DateTimeTrigger(moment=moment))
    timer = as_timer(build_trigger(classpath, kwargs))
    assert timer is not None
    fired: asyncio.Queue[tuple[float, EventKind, Any]] = asyncio.Queue()
    runner = TriggerRunner(lambda held, kind, payload: fired.put_nowait(
        (pendulum.now("UTC").timestamp(), kind, payload)))
    runner.start(Held(1, 1, "q", classpath, None, None, None), timer)
    assert fired.empty()
    at, kind, payload = await asyncio.wait_for(fired.get(), 3)
    assert moment.timestamp() <= at < moment.timestamp() + 0.2
    assert (kind, serde(payload)) == await airflow_event(build_trigger(classpath, kwargs))


def test_what_is_not_a_plain_timer_runs_as_airflows_coroutine() -> None:
    from airflow.providers.standard.triggers.file import FileTrigger
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.timers import as_timer

    class Subclass(DateTimeTrigger):
        pass

    assert as_timer(DateTimeTrigger(target_time="{{ data_interval_end }}")) is None
    assert as_timer(Subclass(moment=pendulum.now("UTC"))) is None
    assert as_timer(FileTrigger(filepath="/tmp/x")) is None


def test_kwargs_decode_with_airflows_code_and_key() -> None:
    from airflow.providers.standard.triggers.file import FileTrigger

    from triggerflow.airflow.kwargs import build_trigger, decode_kwargs

    original = FileTrigger(filepath="/data/in.csv", recursive=True, poke_interval=2.5)
    classpath, kwargs = stored(original)
    assert not kwargs.startswith("{")  # encrypted with the Fernet key from Airflow's config
    assert decode_kwargs(kwargs) == original.serialize()[1]
    rebuilt = build_trigger(classpath, kwargs)
    assert type(rebuilt) is FileTrigger
    assert rebuilt.serialize() == original.serialize()


def test_kwargs_under_another_fernet_key_do_not_decode() -> None:
    from cryptography.fernet import Fernet, InvalidToken

    from triggerflow.airflow.kwargs import decode_kwargs

    foreign = Fernet(Fernet.generate_key()).encrypt(b'{"a": 1}').decode()
    with pytest.raises(InvalidToken):
        decode_kwargs(foreign)


async def test_runner_outcomes_encode_as_airflow_events_do() -> None:
    """A heap timer's outcome and the event Airflow's run() yields encode to the same body."""
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.codec import encode_event, encode_outcome
    from triggerflow.airflow.kwargs import build_trigger
    from triggerflow.airflow.timers import as_timer

    for end_from_trigger in (False, True):
        classpath, kwargs = stored(DateTimeTrigger(
            moment=pendulum.datetime(2026, 1, 2, 3, 4, 5, 6, tz="UTC"),
            end_from_trigger=end_from_trigger))
        theirs = encode_event(await anext(build_trigger(classpath, kwargs).run()))
        timer = as_timer(build_trigger(classpath, kwargs))
        assert timer is not None
        assert encode_outcome(timer.timer_kind, timer.timer_payload(timer.deadline())) == theirs


async def test_a_waiting_airflow_timer_costs_under_1kb() -> None:
    """What the consumer keeps per waiting DateTimeTrigger: one Held and one heap entry (the
    Airflow trigger object is dropped once mapped)."""
    import gc
    import tracemalloc

    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.timers import as_timer

    n = 20_000
    runner = TriggerRunner(lambda held, kind, payload: None)
    start = pendulum.now("UTC").add(hours=1)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            timer = as_timer(DateTimeTrigger(moment=start.add(microseconds=i)))
            assert timer is not None
            runner.start(Held(i, 1, "team-a", DATETIME_TRIGGER, None, None, None), timer)
        gc.collect()
        per_timer = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
        runner.cancel()
    print(f"\nwaiting Airflow DateTimeTrigger on the heap: {per_timer:.0f} bytes each ({n:,})")
    assert len(runner) == 0
    assert per_timer <= 1024
