"""`triggerflow bench`: the numbers users choose a triggerer by, measured end to end.

Every scenario starts the real ``triggerflow consume`` / ``triggerflow writer`` CLI processes
(default logging and telemetry), defers through the SDK, and reads its results from
PostgreSQL: latency is ``task_instance.updated_at`` (database clock) minus the trigger's
instant (``next_kwargs->>'event'`` of a ``DateTimeTrigger``), statements come from
``pg_stat_statements`` (BEGIN/COMMIT and the pool's reset statements included).

Isolation: its own database (``<database>_bench``, dropped, created and migrated at start),
its own namespace (``tfbench``, or ``<namespace>-bench``) and queues, deleted at the end.
Per-process statement counts: consumers, writers and the SDK log in as their own database
roles (``tfbench_consumer``, ``tfbench_writer``, ``tfbench_sdk``), so ``pg_stat_statements``
(which has no pid) still tells them apart; the bench's own polling runs as the given user
and is never counted.

Scenarios: reference, capacity, burst, held, wide, steady, dbload, periodic, defer, failover,
million, promote, nodeloss, zone (default: all). Bursts print their all-applied time as a multiple of
``reference``, the bare path measured in the same run (``reference.py``). ``airflow``, on
its own, runs the Airflow-mode bench instead (``airflow.py``: a real Airflow 3.3.2 stack;
needs the ``triggerflow[airflow]`` extra); ``airflow-million``, on its own, one consumer
holding 1,000,000 waiting Airflow triggers (``airflow_million.py``); ``airflow-waits``, on
its own, how late tasks resume after short waits under each server (``airflow_waits.py``);
``chaos``, on its own, a randomized fault schedule with a checker of the whole history
(``chaos.py``). ``--quick`` runs tiny sizes (a smoke test). Raw results go to
``bench-results/``; a full run also replaces each scenario's entry in ``bench/results.json`` and rewrites
``docs/performance-results.md`` from it (``results.py``), and plots the burst latency
distributions to ``docs/img/burst-latency.png``.

It lives in the source tree, not the wheel: ``triggerflow bench`` imports it from the checkout
the package was installed from, and the processes it starts find it through ``PYTHONPATH``
(``common.CHECKOUT``). It is also the process the ``defer`` scenario runs 1 or 8 of
(``python -m bench sdk-worker ...``, see ``defer.py``) and exports
``SleepTrigger``, the coroutine trigger of the capacity scenario; keep the top-level imports
of its modules light, consumers import it.
"""


from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import FULL, PLOT, QUICK, SCENARIOS, BenchError, Sizes, SleepTrigger
from bench.harness import Bench
from bench.report import RUNNERS, _tables, plot_bursts, table_summary

if TYPE_CHECKING:
    from rich.console import Console

    from triggerflow.settings import Settings

def run_bench(settings: Settings, scenarios: list[str], quick: bool, *,
              zone_triggers: int | None = None, repeats: int | None = None,
              seed: int | None = None, minutes: float = 5.0, mode: str = "native",
              topology: str = "single") -> int:
    """Run the named scenarios (default all), print tables, save results; exit code."""
    from rich.console import Console

    if "chaos" in scenarios:  # a fault schedule and its checker, not a measurement: alone
        if scenarios != ["chaos"]:
            print("bench chaos runs alone: `triggerflow bench chaos --seed S --minutes M`",
                  file=sys.stderr)
            return 2
        if topology != "single" and mode != "native":
            print("bench chaos --topology cluster runs native mode only", file=sys.stderr)
            return 2
        from bench.chaos import run_chaos

        return run_chaos(settings, seed=seed, minutes=minutes, mode=mode, topology=topology)
    if scenarios == ["airflow"]:  # Airflow mode: a real Airflow stack, not the native harness
        from bench.airflow import run_airflow_bench

        return run_airflow_bench(settings, quick)
    if scenarios == ["airflow-million"]:  # 1,000,000 waiting Airflow triggers, one consumer
        from bench.airflow_million import run_airflow_million

        return run_airflow_million(settings, quick)
    if scenarios == ["airflow-waits"]:  # short waits on a real Airflow stack, both servers
        from bench.airflow_waits import run_airflow_waits

        return run_airflow_waits(settings, quick)
    unknown = [s for s in scenarios if s not in SCENARIOS]
    console = Console(record=True, log_path=False,
                      width=None if sys.stdout.isatty() else 150)
    if unknown:
        console.print(f"[red]unknown scenario(s) {', '.join(unknown)}; choose from "
                      f"{', '.join(SCENARIOS)}")
        return 2
    chosen = [s for s in SCENARIOS if s in scenarios] if scenarios else list(SCENARIOS)
    sizes = QUICK if quick else FULL
    if zone_triggers is not None:
        sizes = dataclasses.replace(sizes, zone=zone_triggers)
    if repeats is not None:
        sizes = dataclasses.replace(sizes, repeats=repeats)
    return asyncio.run(_main(settings, chosen, quick, sizes, console))


def _report(console: Console, name: str, res: dict[str, Any], sizes: Sizes, quick: bool) -> None:
    """Print the scenario's tables; a full run also replaces its record (``results.py``)."""
    tables = _tables(name, res, sizes)
    for table in tables:
        console.print(table)
    if not quick:  # tiny sizes judge nothing
        from bench.results import record

        record(name, tables)


async def _main(settings: Settings, chosen: list[str], quick: bool, sizes: Sizes,
                console: Console) -> int:
    import logging

    from rich.markup import escape

    for noisy in ("aiormq", "aio_pika"):  # broker restarts are reported by the watcher
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    results_dir = Path("bench-results")
    out = results_dir / f"logs-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    b = Bench.create(settings, sizes, console, out)
    results: dict[str, Any] = {
        "started": datetime.now(UTC).isoformat(), "quick": quick, "scenarios": chosen,
        "sizes": sizes.__dict__, "machine": {"cpus": os.cpu_count(), "python": sys.version},
        "command": "triggerflow bench " + " ".join([*chosen, *(["--quick"] if quick else [])]),
    }
    failed: list[str] = []
    try:
        await b.setup()
        for name in chosen:
            console.rule(f"[b]{name}")
            t0 = time.monotonic()
            res = None
            for attempt in range(1, 4):
                losses = b.broker_losses
                try:
                    res = await RUNNERS[name](b)
                    break
                except Exception as exc:
                    await b.stop_all()
                    if attempt < 3 and b.broker_losses != losses:
                        console.log(f"[yellow]{name}: the broker restarted during the scenario "
                                    f"({escape(repr(exc))[:200]}); running it again")
                        await asyncio.sleep(5)
                        continue
                    if isinstance(exc, BenchError):
                        console.print(f"[red]{name} failed:[/] {escape(str(exc))}")
                    else:
                        console.print_exception(max_frames=5)
                    break
            if res is None:
                failed.append(name)
                continue
            res["duration_s"] = time.monotonic() - t0
            results[name] = res
            try:
                _report(console, name, res, sizes, quick)
            except Exception:
                console.print_exception(max_frames=5)
                failed.append(name)
            console.log(f"{name} took {res['duration_s']:.0f}s")
    finally:
        await b.teardown()
    console.rule("[b]summary")
    console.print(table_summary(results))
    if failed:
        console.print(f"[red]failed scenarios: {', '.join(failed)}")
    path = results_dir / f"bench-{stamp}{'-quick' if quick else ''}.json"
    path.write_text(json.dumps(results, indent=1, default=str))
    console.print(f"raw results: {path}")
    if "burst" in results and not quick and PLOT.parent.parent.is_dir() and plot_bursts(
            results["burst"], PLOT):
        console.print(f"burst latency plot: {PLOT}")
    (results_dir / f"bench-{stamp}{'-quick' if quick else ''}.txt").write_text(
        console.export_text())
    return 1 if failed else 0


__all__ = ["SCENARIOS", "SleepTrigger", "run_bench"]
