"""``keeps_running`` triggers in the runner (Airflow's asset watchers and callback triggers,
``triggerflow/airflow/watchers.py``): every event is emitted, the trigger stays held between
events, a ``run()`` that ends after its events ends quietly (no failure event), and a cancel
still runs ``cleanup()``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from triggerflow.model import EventKind
from triggerflow.runner import Held, TriggerRunner
from triggerflow.triggers.base import BaseTrigger, TriggerEvent


class Stream(BaseTrigger):
    keeps_running = True

    def __init__(self, events: int, then_wait: bool) -> None:
        self.events = events
        self.then_wait = then_wait
        self.cleaned = False

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return "tests.test_runner_keeps_running.Stream", {}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        for n in range(self.events):
            await asyncio.sleep(0.01)
            yield TriggerEvent({"n": n})
        if self.then_wait:
            await asyncio.Event().wait()

    async def cleanup(self) -> None:
        self.cleaned = True


class Once(Stream):
    keeps_running = False


async def _until(check: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_every_event_is_emitted_and_an_ended_stream_ends_quietly() -> None:
    out: list[tuple[int, EventKind, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: out.append((held.id, kind, payload)))
    ends, waits = Stream(3, then_wait=False), Stream(2, then_wait=True)
    runner.start(Held(1, 1, "q", "c", None, None, None), ends)
    runner.start(Held(2, 1, "q", "c", None, None, None), waits)
    await _until(lambda: ends.cleaned and len([o for o in out if o[0] == 2]) == 2)
    assert [(k, p) for i, k, p in out if i == 1] == [(EventKind.RESUME, {"n": n})
                                                     for n in range(3)]
    assert [(k, p) for i, k, p in out if i == 2] == [(EventKind.RESUME, {"n": n})
                                                     for n in range(2)]
    assert 1 not in runner.running  # ended after its events: gone, with no failure event
    assert 2 in runner.running and not waits.cleaned  # still held after two events
    assert [h.id for h in runner.cancel([2])] == [2]
    await runner.wait_cleanups()
    await _until(lambda: waits.cleaned)
    assert len(out) == 5 and len(runner) == 0


async def test_a_first_event_still_ends_an_ordinary_trigger() -> None:
    out: list[tuple[int, EventKind, Any]] = []
    runner = TriggerRunner(lambda held, kind, payload: out.append((held.id, kind, payload)))
    once = Once(3, then_wait=False)
    runner.start(Held(1, 1, "q", "c", None, None, None), once)
    await _until(lambda: once.cleaned)
    assert out == [(1, EventKind.RESUME, {"n": 0})]
