"""Native mode's burst, measured inside ``triggerflow bench airflow`` so that the Airflow
burst's target (within 2x of native mode's, same N) compares two numbers of one run.

It is the ``burst`` scenario's own code (``scenarios._burst_once``: one ``consume``, one
``writer``, N ``DateTimeTrigger`` deferred through the SDK, firing at one instant
``lead + N/2,500`` s ahead, latency = ``updated_at`` minus the instant) on the native bench
harness (its own database ``<database>_bench`` and namespace, dropped afterwards).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import FULL, QUICK, median_of
from bench.harness import Bench
from bench.scenarios import _burst_once

if TYPE_CHECKING:
    from rich.console import Console

    from triggerflow.settings import Settings


async def _bursts(settings: Settings, counts: tuple[int, ...], repeats: int, quick: bool,
                  console: Console, out: Path) -> dict[int, dict[str, Any]]:
    # The Airflow bench's instant rule (2.5 s + N/2,500 s) for both modes, even in --quick.
    sizes = dataclasses.replace(QUICK if quick else FULL, burst=counts, repeats=repeats,
                                lead=FULL.lead)
    b = Bench.create(settings, sizes, console, out)
    results: dict[int, dict[str, Any]] = {}
    try:
        await b.setup()
        await b.reset()
        await b.start_writer()
        await b.start_consumer()
        for n in counts:
            runs = []
            for i in range(repeats):
                r = await b.measured(f"native burst {n}", functools.partial(_burst_once, b, n))
                r.pop("latencies", None)
                # the writer's database time per event (airflow_floor compares Airflow mode's)
                writer_ms = sum(x["total_ms"] for x in r.pop("by_statement", [])
                                if x["role"] == "writer")
                r["writer_us_per_event"] = writer_ms * 1000 / max(1, r["applied"])
                runs.append(r)
                b.log(f"native burst N={n:,} run {i + 1}/{repeats}: {r['applied']:,} applied, "
                      f"all in {r['all_applied']:.3f}s")
            results[n] = {"runs": runs, **{k: median_of(runs, k) for k in (
                "p50", "p99", "all_applied", "stmts_per_event", "writer_us_per_event")},
                "applied": min(r["applied"] for r in runs)}
    finally:
        await b.teardown()
    return results


def native_bursts(settings: Settings, counts: tuple[int, ...], repeats: int, quick: bool,
                  console: Console, out: Path) -> dict[int, dict[str, Any]]:
    """Median all-applied time (and p50, p99) of ``repeats`` native bursts per N."""
    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_bursts(settings, counts, repeats, quick, console, out))
