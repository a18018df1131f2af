"""The Airflow consumer's pieces, in process: Airflow trigger rows -> runner -> the event body
``AirflowStore`` applies, through ``AirflowLoader`` and ``codec.wire_outcome`` exactly as
``triggerflow consume --airflow`` wires them (``airflow/mode.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pendulum
import pytest

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from triggerflow.loader import BadKwargs, Disallowed, Unloadable
from triggerflow.model import EventKind
from triggerflow.runner import Held, TriggerRunner
from triggerflow.store.interface import KwargsError, KwargsProblem, TriggerSpec

ALLOWED = ["airflow.providers.standard.triggers", "tests.airflow_triggers"]


def spec_of(trigger: Any, trigger_id: int = 1, not_before: float | None = None) -> TriggerSpec:
    """The spec ``AirflowStore.claim`` makes of the row Airflow writes for ``trigger``."""
    from airflow.models.trigger import Trigger

    from triggerflow.airflow.kwargs import decode_kwargs

    row = Trigger.from_object(trigger)
    return TriggerSpec(trigger_id, 1, "team-a", row.classpath,
                       decode_kwargs(row.encrypted_kwargs), None, "dag.task",
                       not_before=not_before)


async def fire(trigger: Any, timeout: float = 10,
               not_before: float | None = None) -> tuple[EventKind, Any]:
    """Run ``trigger`` as the Airflow consumer does; the (kind, wire value) it emits."""
    from triggerflow.airflow.codec import wire_outcome
    from triggerflow.airflow.loader import AirflowLoader

    spec = spec_of(trigger, not_before=not_before)
    fired: asyncio.Future[tuple[EventKind, Any]] = asyncio.get_running_loop().create_future()
    runner = TriggerRunner(lambda held, kind, payload: fired.set_result(
        wire_outcome(kind, payload)))
    held = Held(spec.id, spec.attempt, spec.queue, spec.classpath, spec.task, None, None)
    runner.start(held, AirflowLoader(ALLOWED).build(spec))
    try:
        return await asyncio.wait_for(fired, timeout)
    finally:
        runner.cancel()
        await runner.wait_cleanups()


async def test_a_raising_trigger_fails_with_airflows_traceback_list() -> None:
    from airflow.models.trigger import TriggerFailureReason

    from tests.airflow_triggers import RaisingTrigger

    kind, body = await fire(RaisingTrigger(message="boom on purpose"))
    assert kind is EventKind.FAIL
    assert set(body) == {"error", "traceback"}  # submit_failure's next_kwargs, nothing more
    assert body["error"] == TriggerFailureReason.TRIGGER_FAILURE.value
    # traceback.format_exception's list: header, frames, then the exception line.
    assert body["traceback"][0] == "Traceback (most recent call last):\n"
    assert body["traceback"][-1] == "RuntimeError: boom on purpose\n"
    assert any("airflow_triggers.py" in line for line in body["traceback"])


async def test_a_coroutine_trigger_resumes_with_airflows_serde_payload() -> None:
    from airflow.providers.standard.triggers.file import FileTrigger
    from airflow.sdk.serde import serialize

    kind, body = await fire(FileTrigger(filepath=__file__, poke_interval=0.1))
    assert kind is EventKind.RESUME
    theirs = await anext(FileTrigger(filepath=__file__, poke_interval=0.1).run())
    assert body == json.loads(json.dumps(serialize(theirs.payload)))


async def test_a_task_end_event_goes_through_encode_event() -> None:
    from airflow.triggers.base import BaseTrigger, TaskSuccessEvent

    from triggerflow.airflow.codec import encode_event
    from triggerflow.airflow.loader import AirflowCoroutine

    class EndsTask(BaseTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            return "tests.EndsTask", {}

        async def run(self) -> Any:
            yield TaskSuccessEvent(xcoms={"rows": 3, "when": pendulum.datetime(2026, 1, 1)})

    event = await anext(AirflowCoroutine(EndsTask()).run())
    kind, body = encode_event(TaskSuccessEvent(xcoms={"rows": 3,
                                                      "when": pendulum.datetime(2026, 1, 1)}))
    assert event.kind is EventKind.SUCCESS and kind == "success"
    from triggerflow.airflow.codec import wire_outcome

    assert wire_outcome(event.kind, event.payload) == (EventKind.SUCCESS, json.loads(body))


async def test_airflow_timers_go_on_the_heap_and_encode_as_airflows_run() -> None:
    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.codec import encode_event
    from triggerflow.airflow.loader import AirflowLoader
    from triggerflow.triggers.base import TimerTrigger

    moment = pendulum.now("UTC").subtract(seconds=1)
    for end_from_trigger in (False, True):
        trigger = DateTimeTrigger(moment=moment, end_from_trigger=end_from_trigger)
        assert isinstance(AirflowLoader(ALLOWED).build(spec_of(trigger)), TimerTrigger)
        kind, body = await fire(trigger)
        theirs_kind, theirs_body = encode_event(await anext(trigger.run()))
        assert (str(kind), body) == (theirs_kind, json.loads(theirs_body))


async def test_a_resume_is_held_until_the_deferral_is_old_enough() -> None:
    """The scheduler race's hold (docs/airflow-race.md): a timer already due whose deferral is too
    recent runs as Airflow's coroutine and resumes no sooner than ``not_before``, with the
    payload Airflow's ``run()`` gives; a task-end event is not held; an old deferral's timer
    stays on the heap."""
    import time

    from airflow.providers.standard.triggers.temporal import DateTimeTrigger

    from triggerflow.airflow.loader import AirflowCoroutine, AirflowLoader
    from triggerflow.triggers.base import TimerTrigger

    moment = pendulum.now("UTC").subtract(seconds=1)
    resumes = DateTimeTrigger(moment=moment)
    not_before = time.time() + 5  # unheld, it fires in well under a second
    assert isinstance(AirflowLoader(ALLOWED).build(spec_of(resumes, not_before=not_before)),
                      AirflowCoroutine)
    kind, body = await fire(resumes, not_before=not_before)
    assert kind is EventKind.RESUME and time.time() >= not_before
    assert body == (await fire(resumes))[1]  # the moment, as without the hold
    ends = DateTimeTrigger(moment=moment, end_from_trigger=True)
    long_after = time.time() + 60
    kind, _ = await fire(ends, timeout=5, not_before=long_after)  # not held: within 5 s
    assert kind is EventKind.SUCCESS
    later = DateTimeTrigger(moment=pendulum.now("UTC").add(seconds=30))
    built = AirflowLoader(ALLOWED).build(spec_of(later, not_before=time.time() + 1))
    assert isinstance(built, TimerTrigger)


def test_the_loader_refuses_as_the_native_one_does() -> None:
    from airflow.providers.standard.triggers.file import FileTrigger

    from triggerflow.airflow.loader import AirflowLoader

    loader = AirflowLoader(["tests.airflow_triggers"])
    with pytest.raises(Disallowed):
        loader.build(spec_of(FileTrigger(filepath="/x")))
    missing = TriggerSpec(1, 1, "q", "tests.airflow_triggers.NoSuchTrigger", {}, None, None)
    with pytest.raises(Unloadable):
        loader.build(missing)
    foreign = TriggerSpec(1, 1, "q", "tests.airflow_triggers.RaisingTrigger", None,
                          KwargsError(KwargsProblem.UNREADABLE_HERE, "other key"), None)
    with pytest.raises(Unloadable):
        loader.build(foreign)
    wrong = TriggerSpec(1, 1, "q", "tests.airflow_triggers.RaisingTrigger", {"nope": 1}, None,
                        None)
    with pytest.raises(BadKwargs):
        loader.build(wrong)
