"""The seam between native and Airflow mode: the mode says what its store can do
(``Capabilities``) and the loops ask that, never the store; only the modes read
``settings.airflow``; the SQL takes ``FAIL_METHOD`` and the failure reasons from ``model``,
never retyped."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

from tests import airflow_support as af
from tests.airflow_support import airflow_db, airflow_template
from tests.conftest import wait_until
from tests.test_airflow_store import defer, served
from triggerflow.model import FAIL_METHOD, FailureReason
from triggerflow.settings import Settings

__all__ = ["airflow_db", "airflow_template", "served"]

PACKAGE = Path(__file__).resolve().parent.parent / "triggerflow"


def _strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``path`` but its docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_no_statement_retypes_the_fail_method_or_a_failure_reason() -> None:
    """Each SQL string formats ``FAIL_METHOD`` and ``FailureReason`` in (``'{FAIL_METHOD}'``),
    so a statement cannot drift from what the in-memory store and Airflow write."""
    quoted = [f"'{FAIL_METHOD}'", *(f"'{reason}'" for reason in FailureReason)]
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for line, string in _strings(path)
             for text in quoted if text in string]
    assert found == []


def test_only_the_modes_read_settings_airflow() -> None:
    """Which mode a process is in is asked once (``modes.mode_for``); everything else asks
    the mode what it can do."""
    allowed = {PACKAGE / "modes.py", PACKAGE / "settings.py"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "airflow" and not (
                    isinstance(node.value, ast.Name) and node.value.id == "triggerflow"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []


class CountingStore:
    """The in-memory store, counting the reaper's ``time_out_orphans`` calls."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.time_outs = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    async def time_out_orphans(self, queues: Any, max_deferral: float) -> list[Any]:
        self.time_outs += 1
        return list(await self.store.time_out_orphans(queues, max_deferral))


async def test_writers_and_consumers_time_deferrals_out_only_where_the_mode_says() -> None:
    """Airflow's scheduler times deferred tasks out: in Airflow mode neither reaper asks
    the store to; in native mode both do."""
    from triggerflow.consumer import Consumer
    from triggerflow.modes import mode_for
    from triggerflow.testing import InMemory
    from triggerflow.writer import Writer

    mem = InMemory()
    for airflow, expected in ((False, 2), (True, 0)):
        settings = Settings(queues=["team-a"], airflow=airflow)
        mode = mode_for(settings)
        store = CountingStore(mem.store)
        writer = Writer(settings, store, mem.transport(),  # type: ignore[arg-type]
                        reaper_queues=mode.writer_queues, capabilities=mode.capabilities)
        consumer = Consumer(settings, store, mem.transport(),  # type: ignore[arg-type]
                            capabilities=mode.capabilities)
        await writer.reaper.time_out_orphans()
        await consumer.reaper.time_out_orphans()
        assert store.time_outs == expected, mode.name
        # and only Airflow mode's store signals a task leaving its trigger
        assert (mode.capabilities.cancel_signal is not None) is airflow


async def test_airflow_modes_cancel_signal_wakes_the_sweep_long_before_its_interval(
        served: str) -> None:
    """The sweep polls once an hour here; a task marked failed in Airflow still reaches
    ``cancel`` because the mode handed the sweep its LISTEN signal."""
    from triggerflow.consumer.cancel import CancelSweep
    from triggerflow.modes import mode_for

    mode = mode_for(Settings(database_url=served, airflow=True))
    assert mode.capabilities.cancel_signal is not None
    trigger_id = await defer(served, "cleared", "team-a")
    store = await mode.connect_store(consumer=True)
    cancelled: list[int] = []
    listening = asyncio.Event()

    async def cancel(ids: list[int]) -> int:
        cancelled.extend(ids)
        return len(ids)

    def held() -> bool:
        listening.set()  # the first sweep runs once LISTEN connected (its wake on connect)
        return True

    sweep = CancelSweep(store, lambda: 1, held, cancel, 3600.0,
                        mode.capabilities.cancel_signal)
    task = asyncio.create_task(sweep.run())
    try:
        await asyncio.wait_for(listening.wait(), 30)
        assert cancelled == []
        await af.scalar(served, "UPDATE task_instance SET state = 'failed' "
                                "WHERE task_id = 'cleared'")
        await wait_until(lambda: asyncio.sleep(0, cancelled), 30,
                         message="the sweep woken by the cancel log's notification")
        # Another notification may sweep again before this line: the fake cancel lets go
        # of nothing, so the same trigger is named again; only which one matters.
        assert set(cancelled) == {trigger_id}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()

