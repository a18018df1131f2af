"""The consumer's fire path alone: what a held burst costs in the consumer's own Python.

A ``TriggerRunner`` with the real ``Outcomes`` and ``EventSink`` holds ``held`` timers, of
which N are due at one instant; publishing is replaced by ``wire.encode_events`` (what the
transport does before the broker). No broker, database or other process shares the CPU, so
this separates the consumer's firing from the rest of ``held``'s "all fired" column, which
also waits on the writer and the broker on a 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bench.common import FAR, BenchError, ms

if TYPE_CHECKING:
    from rich.table import Table

    from bench.harness import Bench

RUNS = 5
LEAD = 0.2  # seconds from the last start to the instant, plus starting time per timer


class _EncodingTransport:
    """Stands in for the broker: encodes each message, counts the events."""

    def __init__(self, want: int) -> None:
        self.published = 0
        self.want = want
        self.done = asyncio.Event()  # set once ``want`` events went out, at finished_at
        self.finished_at = float("nan")

    async def publish_events(self, queue: str, events: list[Any]) -> None:
        from triggerflow.wire import encode_events

        encode_events(events)
        self.published += len(events)
        if self.published >= self.want and not self.done.is_set():
            self.finished_at = time.time()
            self.done.set()


class _Valid:
    def valid(self) -> bool:
        return True


async def fire_once(held: int, due: int) -> dict[str, float]:
    """Seconds from the instant until all ``due`` events were encoded, ``held`` timers held."""
    from triggerflow.consumer.outcomes import Outcomes
    from triggerflow.emitter import EventSink
    from triggerflow.runner import Held, TriggerRunner
    from triggerflow.settings import Settings
    from triggerflow.triggers.temporal import DateTimeTrigger

    settings = Settings()
    transport = _EncodingTransport(due)
    sink = EventSink(transport, settings)  # type: ignore[arg-type]
    outcomes = Outcomes(sink, _Valid(), settings, on_fired=lambda helds: None)  # type: ignore[arg-type]
    runner = TriggerRunner(outcomes.emit, outcomes.emit_many)
    instant = time.time() + LEAD + held / 50_000
    moment, far = (datetime.fromtimestamp(t, UTC) for t in (instant, instant + FAR))
    classpath = "triggerflow.triggers.temporal.DateTimeTrigger"
    for i in range(held):
        runner.start(Held(i + 1, 1, "bench", classpath, None, None, None),
                     DateTimeTrigger(moment if i < due else far))
    with contextlib.suppress(TimeoutError):  # reported by the scenario
        await asyncio.wait_for(transport.done.wait(), instant - time.time() + 30)
    done = transport.finished_at - instant
    runner.cancel(list(runner.running))
    return {"all_fired": done, "published": transport.published}


async def scenario_fire(b: Bench) -> dict[str, Any]:
    due = max(b.sizes.held_burst)
    runs = []
    for i in range(RUNS):
        runs.append(await fire_once(b.sizes.held + due, due))
        b.console.log(f"fire: run {i + 1}/{RUNS}: all fired {ms(runs[-1]['all_fired'])}")
    if any(r["published"] != due for r in runs):
        raise BenchError(f"fire: not every due timer fired within 30 s: {runs}")
    return {"held": b.sizes.held, "due": due, "runs": runs,
            "all_fired": statistics.median(r["all_fired"] for r in runs)}


def table_fire(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title=f"Fire path alone: {res['due']:,} timers due at one instant beside "
              f"{res['held']:,} held, one runner, publishing replaced by encoding")
    for col in ("N", "all fired (median)", "per timer", "runs"):
        t.add_column(col, justify="right")
    runs: Sequence[dict[str, float]] = res["runs"]
    t.add_row(f"{res['due']:,}", ms(res["all_fired"]),
              f"{res['all_fired'] / res['due'] * 1e6:.2f} µs",
              ", ".join(ms(r["all_fired"]) for r in runs))
    t.caption = ("All fired = the last event encoded - the instant, in this process only "
                 "(no broker, database or writer on the CPU).")
    return t
