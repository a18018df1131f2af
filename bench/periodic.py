"""Scenario periodic: what waiting costs the database, by triggers held and by processes.

Two measurements, each over a window long enough to hold every periodic statement (renewal
each second, cancel sweep every 5 s, reaper every 10 s):

- one consumer and one writer while the consumer holds N waiting timers: database time
  (``pg_stat_statements.total_exec_time``) of both per second, and their statements/s;
- K idle consumers, one queue each, nothing held: statements/s per process.
"""


from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, num
from bench.harness import Bench, _run_id

if TYPE_CHECKING:
    from rich.table import Table


async def _window(b: Bench) -> tuple[list[dict[str, Any]], float]:
    await b.stmt_reset()
    await asyncio.sleep(b.sizes.periodic_window)
    return await b.stmt_snapshot(), b.sizes.periodic_window


async def _held(b: Bench, n: int) -> dict[str, Any]:
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    b.log(f"periodic: deferring {n:,} far timers")
    await b.defer(n, _run_id("periodic"))
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL", n, 600)
    if not ok:
        raise BenchError(f"the consumer claimed only {await b.owned():,} of {n:,}")
    await b.analyze(vacuum=True)  # the steady state: autovacuum has been by
    await asyncio.sleep(b.sizes.settle)
    busy = await b.quiet()
    b.log(f"periodic: {n:,} held; measuring {b.sizes.periodic_window:.0f}s")
    stmts, window = await _window(b)
    roles = ("consumer", "writer")
    return {"held": n, "window_s": window, "machine_busy_before": busy,
            "db_ms_per_s": sum(s["total_ms"] for s in stmts if s["role"] in roles) / window,
            "stmts_per_s": {r: sum(s["calls"] for s in stmts if s["role"] == r) / window
                            for r in roles},
            "by_statement": stmts}


async def _idle(b: Bench, k: int) -> dict[str, Any]:
    assert b.broker is not None
    await b.reset()
    queues = [f"{b.namespace}.idle-{i}" for i in range(k)]
    await b.broker.declare(queues)
    try:
        procs = [b.start("consume", "--queue", q) for q in queues]
        b.log(f"periodic: starting {k} idle consumers")
        ok, _ = await b.wait_for(
            "SELECT count(*) FROM consumer WHERE kind = 'consumer'", k, 300, interval=0.5)
        if not ok or not all(p.alive() for p in procs):
            raise BenchError(f"not all {k} consumers registered; see {b.out}")
        await asyncio.sleep(b.sizes.settle + b.sizes.periodic_window / 3)  # start-up is over
        busy = await b.quiet()
        stmts, window = await _window(b)
        calls = sum(s["calls"] for s in stmts if s["role"] == "consumer")
        db_ms = sum(s["total_ms"] for s in stmts if s["role"] == "consumer")
        return {"processes": k, "window_s": window, "machine_busy_before": busy,
                "stmts_per_s_per_process": calls / window / k,
                "db_ms_per_s_per_process": db_ms / window / k, "by_statement": stmts}
    finally:
        await b.stop_all()
        assert b.broker.connection is not None
        for q in queues:
            ch = await b.broker.connection.channel()
            with contextlib.suppress(Exception):
                await ch.queue_delete(q)
            if not ch.is_closed:
                await ch.close()


async def scenario_periodic(b: Bench) -> dict[str, Any]:
    held = [await b.measured(f"periodic {n}", lambda n=n: _held(b, n))  # type: ignore[misc]
            for n in b.sizes.periodic_held]
    idle = [await b.measured(f"idle {k}", lambda k=k: _idle(b, k))  # type: ignore[misc]
            for k in b.sizes.periodic_procs]
    return {"held": held, "idle": idle}


def tables_periodic(res: dict[str, Any]) -> list[Table]:
    from rich.table import Table

    t1 = Table(title="Periodic database work while one consumer holds N waiting timers "
               "(one consumer + one writer)")
    for col in ("held", "DB time / s", "statements/s consumer", "statements/s writer",
                "costliest statement (ms / s)"):
        t1.add_column(col, justify="right")
    for r in res["held"]:
        top = max(r["by_statement"], key=lambda s: s["total_ms"], default=None)
        t1.add_row(num(r["held"]), f"{r['db_ms_per_s']:.3f} ms",
                   f"{r['stmts_per_s']['consumer']:.2f}", f"{r['stmts_per_s']['writer']:.2f}",
                   f"{top['statement']} ({top['total_ms'] / r['window_s']:.3f})" if top else "-")
    t1.caption = ("pg_stat_statements total_exec_time of the consumer and writer roles over "
                  f"{res['held'][0]['window_s']:.0f} s, after VACUUM ANALYZE, nothing firing.")
    t2 = Table(title="Idle consumers, one queue each: statements per process")
    for col in ("processes", "statements/s per process", "DB time / s per process"):
        t2.add_column(col, justify="right")
    for r in res["idle"]:
        t2.add_row(num(r["processes"]), f"{r['stmts_per_s_per_process']:.2f}",
                   f"{r['db_ms_per_s_per_process']:.3f} ms")
    t2.caption = (f"Calls of the consumer role over {res['idle'][0]['window_s']:.0f} s "
                  "divided by processes; start-up excluded.")
    return [t1, t2]
