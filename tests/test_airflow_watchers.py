"""A watcher row's trigger (``triggerflow/airflow/watchers.py``) in the consumer's runner: what
trigger code may rely on at every step and every start, not only the first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from tests.airflow_support import airflow_3_3_only
from tests.conftest import wait_until
from triggerflow.runner import Held, TriggerRunner


async def test_every_step_of_a_watcher_has_its_portal_and_its_identity() -> None:
    """Each step after an event runs in a new task of the runner's: the greenback portal (a
    sync SDK call such as ``asset_state_store.set`` from ``run()``) and ``CURRENT_TRIGGER``
    (the runtime's per-trigger bound) must hold there too. Before the fix the second step
    had neither: a watcher's sync call after its first event raised."""
    import greenback
    from airflow.triggers.base import BaseEventTrigger, TriggerEvent

    from triggerflow.airflow.runtime import CURRENT_TRIGGER
    from triggerflow.airflow.watchers import WatcherCoroutine

    seen: list[tuple[bool, int | None]] = []

    class ThreeSteps(BaseEventTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            return "tests.ThreeSteps", {}

        async def run(self) -> AsyncIterator[TriggerEvent]:
            for step in range(3):
                await asyncio.sleep(0)
                seen.append((greenback.has_portal(), CURRENT_TRIGGER.get()))
                yield TriggerEvent(step)
            await asyncio.Event().wait()  # stays, as a watcher does, until cancelled

    events: list[int] = []
    runner = TriggerRunner(lambda held, kind, payload: events.append(held.id))
    runner.start(Held(7, 1, "q", "c", None, None, None), WatcherCoroutine(ThreeSteps))
    await wait_until(lambda: asyncio.sleep(0, len(events) == 3), 5, interval=0.01,
                     message="three events")
    runner.cancel([7])
    await runner.wait_cleanups()
    assert seen == [(True, 7)] * 3


@airflow_3_3_only  # the asset state store is Airflow 3.3's
async def test_each_start_gets_the_asset_state_store_of_the_assets_watched_then() -> None:
    """As Airflow's runner: an event trigger of a watcher row is given ``asset_state_store``
    over the row's watched assets, read at each start (a DAG may change them between two);
    a read that fails leaves that run without one, logged, and the next start reads again."""
    from airflow.triggers.base import BaseEventTrigger, TriggerEvent

    from triggerflow.airflow.watchers import WatcherCoroutine

    reads: list[int] = []
    answers: list[Any] = [{"orders": "s3://b/orders"}, RuntimeError("database down"),
                          {"orders": "s3://b/orders", "refunds": "s3://b/refunds"}]

    def assets_of(trigger_id: int) -> dict[str, str] | None:
        reads.append(trigger_id)
        answer = answers[min(len(reads), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return dict(answer)

    given: list[str] = []

    class OneShot(BaseEventTrigger):
        def serialize(self) -> tuple[str, dict[str, Any]]:
            return "tests.OneShot", {}

        async def run(self) -> AsyncIterator[TriggerEvent]:
            given.append(repr(self.asset_state_store))
            yield TriggerEvent(len(given))

    events: list[int] = []
    runner = TriggerRunner(lambda held, kind, payload: events.append(held.id))
    runner.start(Held(5, 1, "q", "c", None, None, None),
                 WatcherCoroutine(OneShot, restart_delay=0.01, assets_of=assets_of))
    await wait_until(lambda: asyncio.sleep(0, len(events) >= 3), 5, interval=0.01,
                     message="three starts")
    runner.cancel([5])
    await runner.wait_cleanups()
    assert reads[:3] == [5, 5, 5]
    assert given[:3] == [
        "<AssetStateStoreAccessors [name='orders']>",
        "None",
        "<AssetStateStoreAccessors [name='orders', name='refunds']>",
    ]
