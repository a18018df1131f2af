"""The loop's shared heap: the long waits of trigger tasks, and nothing else, are kept there."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from triggerflow import loop as trigger_loop
from triggerflow.runner import Held, TriggerRunner
from triggerflow.triggers.base import BaseTrigger, TriggerEvent

pytest.importorskip("uvloop")

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return trigger_loop.run(coro)


def in_trigger_task(coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    return trigger_loop.HeapTimedTask(coro, loop=asyncio.get_running_loop())


def shared(loop: Any) -> list[Any]:
    return [t for t in loop._heap if not t.cancelled()]


@pytest.mark.serial  # timing bound (woken within 0.25 s): runs alone, after the parallel part
def test_a_trigger_tasks_long_sleep_is_on_the_shared_heap_and_wakes_on_time() -> None:
    async def main() -> None:
        loop: Any = asyncio.get_running_loop()
        handles: list[Any] = []

        async def sleeper(seconds: float) -> float:
            start = loop.time()
            handles.append(loop.call_later(seconds, lambda: None))  # what sleep() calls
            await asyncio.sleep(seconds)
            return float(loop.time() - start)

        tasks = [in_trigger_task(sleeper(s)) for s in (1.3, 1.1, 1.2)]
        await asyncio.sleep(0)
        assert all(isinstance(h, trigger_loop.SharedTimer) for h in handles)
        assert len(shared(loop)) == 6  # three sleeps, three probes
        slept = await asyncio.gather(*tasks)
        for took, wanted in zip(slept, (1.3, 1.1, 1.2), strict=True):
            assert wanted - 0.005 <= took < wanted + 0.25
        assert shared(loop) == []
        # outside a trigger task, and short waits inside one: uvloop's own timers
        assert not isinstance(loop.call_later(5, lambda: None), trigger_loop.SharedTimer)

        async def short() -> Any:
            return loop.call_later(0.5, lambda: None)

        assert not isinstance(await in_trigger_task(short()), trigger_loop.SharedTimer)

    run(main())


@pytest.mark.serial  # timing bound (timed out within 0.4 s): runs alone, after the parallel part
def test_timeouts_cancel_and_the_heap_drops_cancelled_entries() -> None:
    async def main() -> None:
        loop: Any = asyncio.get_running_loop()

        async def waits_with_timeouts() -> str:
            done = asyncio.Event()
            done.set()
            for _ in range(300):  # each leaves a cancelled 1-hour timer behind
                await asyncio.wait_for(done.wait(), timeout=3600)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.2):
                    await asyncio.Event().wait()
            return VAR.get()

        VAR.set("caller's")
        took = loop.time()
        assert await in_trigger_task(waits_with_timeouts()) == "caller's"
        assert 1.2 - 0.005 <= loop.time() - took < 1.6
        assert len(loop._heap) <= 200, "cancelled timers are compacted away, not kept an hour"

    run(main())


class Sleeps(BaseTrigger):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("tests.test_loop.Sleeps", {"seconds": self.seconds})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(self.seconds)
        yield TriggerEvent(self.seconds)


def test_runner_triggers_sleep_on_the_heap_and_skip_the_loops_generator_registry() -> None:
    async def main() -> None:
        loop: Any = asyncio.get_running_loop()
        fired: list[Any] = []
        runner = TriggerRunner(lambda held, kind, payload: fired.append(payload))
        firstiter, finalizer = sys.get_asyncgen_hooks()
        assert firstiter is not None
        seen: list[Any] = []

        def spy(agen: Any) -> None:
            seen.append(agen)
            firstiter(agen)

        sys.set_asyncgen_hooks(firstiter=spy, finalizer=finalizer)
        try:
            for i, seconds in enumerate((1.1, 3600.0)):
                runner.start(Held(i, 1, "q", "tests.test_loop.Sleeps", None, None, None),
                             Sleeps(seconds))
        finally:
            sys.set_asyncgen_hooks(firstiter=firstiter, finalizer=finalizer)
        await asyncio.sleep(0.05)
        assert len(shared(loop)) == 2
        assert seen == []  # not in the loop's generator registry: the runner closes them
        assert sys.get_asyncgen_hooks().firstiter is firstiter
        await asyncio.sleep(1.3)
        assert fired == [1.1]
        runner.cancel()
        await runner.wait_cleanups()
        assert shared(loop) == []

    run(main())
