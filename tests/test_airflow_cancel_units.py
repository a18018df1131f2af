"""``on_kill()`` where Airflow 3.3.2's triggerer calls it (3.2's never does), in process: an Airflow trigger run
by triggerflow's runner (``loader.AirflowCoroutine``) and cancelled the ways a consumer
cancels. Airflow's rule (``TriggerRunner.run_trigger``): a cancel because the task ended
calls ``on_kill()`` unless the task's ``trigger_timeout`` has passed; every cancel then calls
``cleanup()``; a shutdown or hand-over calls ``cleanup()`` only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from tests.airflow_cancel_triggers import STEPS, MarkerTrigger
from tests.airflow_support import airflow_minor
from triggerflow.runner import Held, TriggerRunner

MINOR = airflow_minor()


async def cancelled(tmp_path: Any, trigger_id: int, kills: dict[int, bool] | None) -> set[str]:
    """Start a MarkerTrigger, cancel it (after recording ``kills`` as the cancel log's read
    would: id -> timed out), return the steps it marked."""
    from triggerflow.airflow.cancels import KILLS
    from triggerflow.airflow.loader import AirflowCoroutine

    runner = TriggerRunner(lambda *a: None)
    trigger = AirflowCoroutine(MarkerTrigger(folder=str(tmp_path), name="t"))
    classpath = "tests.airflow_cancel_triggers.MarkerTrigger"
    runner.start(Held(trigger_id, 1, "q", classpath, "d.t", None, None), trigger)
    for _ in range(100):
        if (tmp_path / f"t.{trigger_id}.run").exists():
            break
        await asyncio.sleep(0.01)
    if kills is not None:
        KILLS.record(list(kills), {i for i, timed_out in kills.items() if timed_out})
    runner.cancel([trigger_id])
    await runner.wait_cleanups(timeout=10)
    return {s for s in STEPS if (tmp_path / f"t.{trigger_id}.{s}").exists()}


@pytest.mark.parametrize(
    ("kills", "steps"),
    [
        # cleared, marked, run deleted (Airflow 3.2's triggerer calls no on_kill())
        ({7: False}, {"run", "cancel", "cleanup"} | ({"on_kill"} if MINOR != "3.2" else set())),
        ({7: True}, {"run", "cancel", "cleanup"}),  # timed out: killed, not cancelled
        (None, {"run", "cancel", "cleanup"}),  # shutdown, hand-over, lost lease
        ({8: False}, {"run", "cancel", "cleanup"}),  # another trigger's task ended
    ],
)
async def test_on_kill_only_when_the_task_ended_before_its_timeout(
    tmp_path: Any, kills: dict[int, bool] | None, steps: set[str]
) -> None:
    assert await cancelled(tmp_path, 7, kills) == steps
