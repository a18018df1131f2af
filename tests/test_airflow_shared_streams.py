"""Asset watchers that share I/O share it under triggerflow too: Airflow 3.3's triggerer
runs every ``BaseEventTrigger`` with the same ``shared_stream_key`` (e.g.
``DirectoryFileDeleteTrigger``s on one directory) on one ``open_shared_stream`` poll, and so
does ``WatcherCoroutine`` (``triggerflow/airflow/watchers.py``). The real provider trigger,
in the consumer's runner; its scan is counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import tests.airflow_support  # noqa: F401 - configures Airflow before it is imported
from tests.airflow_support import airflow_3_3_only
from tests.conftest import wait_until
from triggerflow.model import EventKind
from triggerflow.runner import Held, TriggerRunner

pytestmark = airflow_3_3_only  # shared streams are Airflow 3.3's


async def test_watchers_on_one_directory_share_one_scan(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.providers.standard.triggers.file import DirectoryFileDeleteTrigger

    from triggerflow.airflow.watchers import WatcherCoroutine, shared_streams

    scans: list[str] = []
    scan = DirectoryFileDeleteTrigger.open_shared_stream.__func__  # type: ignore[attr-defined]

    async def counted(cls: type, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        scans.append(kwargs["directory"])
        async for snapshot in scan(cls, kwargs):
            yield snapshot

    monkeypatch.setattr(DirectoryFileDeleteTrigger, "open_shared_stream", classmethod(counted))
    out: list[tuple[int, EventKind]] = []
    runner = TriggerRunner(lambda held, kind, payload: out.append((held.id, kind)))
    def build(name: str) -> Any:
        return lambda: DirectoryFileDeleteTrigger(directory=str(tmp_path), filename=name,
                                                  poke_interval=0.05)

    for held_id, name in ((1, "a"), (2, "b")):
        runner.start(Held(held_id, 1, "q", "c", None, None, None), WatcherCoroutine(build(name)))
    await asyncio.sleep(0.2)
    for name in ("a", "b"):
        (tmp_path / name).write_text("")
    await wait_until(lambda: asyncio.sleep(0, len(out) == 2), 5, interval=0.01,
                     message="both watchers fired")
    # both fired from one directory scan (each run() alone would scan once per trigger)
    assert sorted(out) == [(1, EventKind.RESUME), (2, EventKind.RESUME)]
    assert scans == [str(tmp_path)]
    assert list(tmp_path.iterdir()) == []
    runner.cancel([1, 2])
    await runner.wait_cleanups()
    assert shared_streams()._groups == {}  # the poll stopped with its last trigger


def test_only_triggers_that_ask_for_it_share() -> None:
    from airflow.providers.standard.triggers.file import (
        DirectoryFileDeleteTrigger,
        FileDeleteTrigger,
    )

    from triggerflow.airflow.watchers import ack_mode, shared_key

    directory = DirectoryFileDeleteTrigger(directory="/x/", filename="f", poke_interval=1.0)
    assert shared_key(directory) == ("directory-scan", "/x", 1.0)
    assert shared_key(FileDeleteTrigger(filepath="/x/f")) is None  # the default: its own run()

    class AckMode(DirectoryFileDeleteTrigger):
        def create_shared_stream_producer(self, kwargs: dict[str, Any]) -> Any:  # type: ignore[override]
            raise AssertionError("not called")

    # shared too, in ack mode: the writer confirms each event's commit (persisted.py)
    assert shared_key(AckMode(directory="/x", filename="f")) == ("directory-scan", "/x", 5.0)
    assert ack_mode(AckMode) and not ack_mode(DirectoryFileDeleteTrigger)


async def test_a_cancel_while_leaving_the_stream_stops_the_watcher(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A watcher cancelled while it leaves its stream (Airflow's ``group.stop()`` awaits the
    poll under ``suppress(CancelledError)``) stops; it is not started again. A CI run had
    the cancel swallowed there, the watcher restarted and its stream left running."""
    from airflow.providers.standard.triggers.file import DirectoryFileDeleteTrigger

    from triggerflow.airflow.watchers import WatcherCoroutine, shared_streams

    scan = DirectoryFileDeleteTrigger.open_shared_stream.__func__  # type: ignore[attr-defined]
    stopping = asyncio.Event()

    async def slow_to_stop(cls: type, kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        try:
            async for snapshot in scan(cls, kwargs):
                yield snapshot
        finally:
            stopping.set()
            await asyncio.sleep(0.5)  # the poll's own clean-up: the window for the cancel

    monkeypatch.setattr(DirectoryFileDeleteTrigger, "open_shared_stream",
                        classmethod(slow_to_stop))
    out: list[int] = []
    built: list[int] = []

    def build() -> Any:
        built.append(1)
        return DirectoryFileDeleteTrigger(directory=str(tmp_path), filename="a",
                                          poke_interval=0.05)

    runner = TriggerRunner(lambda held, kind, payload: out.append(held.id))
    runner.start(Held(1, 1, "q", "c", None, None, None), WatcherCoroutine(build, 0.2))
    await asyncio.sleep(0.2)
    (tmp_path / "a").write_text("")
    # the watcher fired and ended its run(); it is now leaving the stream, which stops
    await asyncio.wait_for(stopping.wait(), 5)
    runner.cancel([1])
    await runner.wait_cleanups(timeout=3.0)
    await asyncio.sleep(0.5)  # a watcher started again would have built a second trigger
    assert out == [1]
    assert built == [1]
    assert not runner._cleanups  # the task ended
    assert shared_streams()._groups == {}
