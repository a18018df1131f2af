"""Scenarios capacity, burst and steady, and their tables."""


from __future__ import annotations

import asyncio
import functools
import math
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from bench.common import (
    FAR,
    BenchError,
    SleepTrigger,
    _proc_rss,
    cpu_percent,
    dist,
    median_of,
    ms,
    num,
    pct,
)
from bench.harness import Bench, _run_id
from bench.reference import reference_run

if TYPE_CHECKING:
    from rich.table import Table

async def scenario_capacity(b: Bench) -> dict[str, Any]:
    """One consumer holding N waiting triggers: RSS per trigger, CPU, claim+start time."""
    rows = []
    cases: list[tuple[str, int]] = [("timer", n) for n in b.sizes.capacity]
    cases.append(("coroutine", b.sizes.capacity_coroutines))
    base_rss, base_cpu = 0, 0.0
    for i, (kind, n) in enumerate(cases):
        await b.reset()
        if i == 0 or b.sizes.baseline_each:
            # Empty baseline: a fresh consumer with nothing to run, settled.
            empty = await b.start_consumer()
            await asyncio.sleep(b.sizes.settle)
            base_rss = _proc_rss(empty.pid)
            base_cpu = (await cpu_percent([empty.pid], b.sizes.cpu_window))[0]
            await b.stop(empty)
            await b.truncate("consumer")
        # Backlog first, then the consumer: the time below is claim+start, not defer speed.
        b.log(f"capacity: {kind} N={n:,}: deferring (no consumer running)")
        run = _run_id("cap")
        make = (lambda i: SleepTrigger(FAR)) if kind == "coroutine" else None
        defer_s = await b.defer(n, run, trigger=make)
        b.log(f"capacity: {kind} N={n:,}: deferred in {defer_s:.1f}s; starting the consumer")
        busy = await b.quiet()
        proc = await b.start_consumer(ready=False)
        ok, t_all = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                                     n, 300)
        reg = await b.db().fetchrow(
            "SELECT extract(epoch FROM started_at)::float8 AS t FROM consumer WHERE pid = $1",
            proc.pid)
        claim = await b.db().fetchrow(
            "SELECT extract(epoch FROM min(claimed_at))::float8 AS first, "
            "extract(epoch FROM max(claimed_at))::float8 AS last FROM trigger")
        if not ok or reg is None or claim is None:
            raise BenchError(f"consumer claimed only {await b.owned():,} of {n:,}; see {proc.log}")
        claim_s = t_all - reg["t"]
        # Started = the runner holds them (reported by the next renewals).
        await b.wait_for("SELECT coalesce(max(running), 0) FROM consumer WHERE pid = $1", n, 30,
                         proc.pid, interval=0.2)
        await asyncio.sleep(b.sizes.settle)
        rss = _proc_rss(proc.pid)
        cpu = (await cpu_percent([proc.pid], b.sizes.cpu_window))[0]
        row = {"kind": kind, "n": n, "defer_s": defer_s, "base_rss": base_rss, "rss": rss,
               "bytes_per_trigger": (rss - base_rss) / n, "cpu_empty_pct": base_cpu,
               "cpu_pct": cpu, "claim_s": claim_s, "claim_rate": n / claim_s,
               "claim_span_s": claim["last"] - claim["first"], "machine_busy_before": busy}
        rows.append(row)
        b.log(f"capacity: {kind} N={n:,}: {row['bytes_per_trigger']:.0f} B/trigger, "
              f"CPU {cpu:.2f}%, all claimed in {claim_s:.2f}s ({row['claim_rate']:,.0f}/s)")
        await b.stop(proc)
    return {"rows": rows}


def table_capacity(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title="Capacity: one consumer holding N waiting triggers (DateTimeTrigger far "
              "ahead; coroutine row: a 1-task-each trigger)")
    for col in ("trigger", "N", "RSS empty", "RSS with N", "per trigger", "CPU empty",
                "CPU waiting", "claim+start all N", "claims/s"):
        t.add_column(col, justify="right")
    for r in res["rows"]:
        t.add_row(r["kind"], num(r["n"]), f"{r['base_rss'] / 2**20:.1f} MiB",
                  f"{r['rss'] / 2**20:.1f} MiB", f"{r['bytes_per_trigger']:.0f} B",
                  f"{r['cpu_empty_pct']:.2f} %", f"{r['cpu_pct']:.2f} %", ms(r["claim_s"]),
                  num(r["claim_rate"]))
    t.caption = ("RSS = VmRSS of the consumer process (/proc/PID/status); per trigger = "
                 "(RSS with N - RSS of a fresh empty consumer) / N. CPU = utime+stime over "
                 "the window while waiting (/proc/PID/stat), % of one core. Claim+start = from "
                 "the consumer's registration (DB clock) until all N are owned, N deferred "
                 "beforehand with no consumer running.")
    return t


async def _burst_once(b: Bench, n: int, *, keep_held: bool = False,
                      defer_rate: float = 2500, analyze: bool = False) -> dict[str, Any]:
    if keep_held:  # the held timers stay; only the previous bursts' tasks go
        await b.db().execute("DELETE FROM task_instance WHERE state <> 'deferred'")
    else:
        await b.truncate("task_instance", "trigger")
    held = await b.owned()
    busy = await b.quiet()
    lead = b.sizes.lead + n / defer_rate  # the deferral must end before the instant
    instant = datetime.now(UTC) + timedelta(seconds=lead)
    run = _run_id(f"burst{n}")
    await b.defer(n, run, lambda i: instant)
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                             held + n, max(0.0, instant.timestamp() - time.time() - 0.4))
    if not ok:
        b.log(f"[yellow]  only {await b.owned() - held:,}/{n:,} claimed before the instant")
    if analyze:  # statistics that know the burst's rows too
        await b.analyze()
    await asyncio.sleep(max(0.0, instant.timestamp() - time.time() - 0.3))
    await b.stmt_reset()
    done, _ = await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE run_id = $1 AND state = 'scheduled'", n, 120,
        run, interval=0.1)
    stmts = await b.stmt_snapshot()
    lat, fired = await b.latencies(run)
    if not done:
        b.log(f"[red]  only {len(lat):,}/{n:,} applied after 120 s")
    d = dist(lat)
    return {**d, "all_applied": d["max"], "applied": len(lat), "claimed_before": ok,
            "fired_p50": pct(fired, 50), "fired_max": max(fired, default=math.nan),
            "machine_busy_before": busy, "held": held,
            "statements": b.calls(stmts), "stmts_per_event": b.calls(stmts) / max(1, len(lat)),
            "by_statement": stmts, "latencies": [round(x, 5) for x in lat]}


async def _bursts(b: Bench, sizes: tuple[int, ...], tag: str, *,
                  keep_held: bool = False, defer_rate: float = 2500,
                  analyze: bool = False) -> dict[str, Any]:
    """Each size ``repeats`` times, each run right after a reference run of the same size
    (interleaved, so a slower minute of the machine slows both); medians and ratios."""
    out: dict[str, Any] = {}
    for n in sizes:
        runs = []
        for i in range(b.sizes.repeats):
            ref = await reference_run(b, n)
            b.log(f"{tag}: N={n:,} run {i + 1}/{b.sizes.repeats}")
            r = await b.measured(f"{tag} {n}", functools.partial(
                _burst_once, b, n, keep_held=keep_held, defer_rate=defer_rate,
                analyze=analyze))
            r["reference_all_applied"] = ref["all_applied"]
            runs.append(r)
            b.log(f"{tag}: N={n:,} run {i + 1}: p50 {ms(r['p50'])}, p99 {ms(r['p99'])}, all "
                  f"applied {ms(r['all_applied'])} ({r['all_applied'] / ref['all_applied']:.2f}"
                  f"x the reference's {ms(ref['all_applied'])}), {r['statements']} statements")
        ref_all = median_of(runs, "reference_all_applied")  # the references of these runs
        out[str(n)] = {
            "runs": runs, "reference_all_applied": ref_all,
            **{k: median_of(runs, k) for k in ("p50", "p95", "p99", "max", "all_applied",
                                               "stmts_per_event", "statements", "fired_max")},
        }
        out[str(n)]["ratio"] = out[str(n)]["all_applied"] / ref_all
    return out


async def scenario_burst(b: Bench) -> dict[str, Any]:
    """N timers firing at one instant; fire -> update percentiles, medians of repeats."""
    await b.reset()
    procs = [await b.start_writer(), await b.start_consumer()]
    out: dict[str, Any] = {"sizes": await _bursts(b, b.sizes.burst, "burst")}
    out["cpu_idle_pct"] = await cpu_percent([p.pid for p in procs], 1.0)
    return out


HOT_TABLES = ("trigger", "task_instance", "consumer")


async def _autovacuum(b: Bench, on: bool) -> None:
    for table in HOT_TABLES:
        await b.db().execute(f"ALTER TABLE {table} SET (autovacuum_enabled = {str(on).lower()})")


async def scenario_held(b: Bench) -> dict[str, Any]:
    """Bursts while the same consumer also holds ``held`` waiting timers, in two states of
    the planner's statistics (issue 22):

    - ``sizes``, no statistics since the deferral wave: the tables were emptied, the held
      timers and each burst deferred through the SDK shortly before, no ANALYZE, and
      autovacuum kept off the hot tables so it cannot catch up mid-run (production's case
      after a wave of mapped tasks deferring to the top of the hour);
    - ``fresh``: the same, with an ANALYZE after each burst's deferral, before its instant.
    """
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    await _autovacuum(b, False)
    try:
        b.log(f"held: deferring {b.sizes.held:,} far timers for the consumer to hold")
        await b.defer(b.sizes.held, _run_id("held"))
        ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                                 b.sizes.held, 300)
        if not ok:
            raise BenchError(f"the consumer claimed only {await b.owned():,} of "
                             f"{b.sizes.held:,}")
        await asyncio.sleep(b.sizes.settle)
        stale = await _bursts(b, b.sizes.held_burst, "held, no statistics", keep_held=True)
        fresh = await _bursts(b, b.sizes.held_burst, "held, fresh statistics", keep_held=True,
                              analyze=True)
    finally:
        await _autovacuum(b, True)
    return {"held": b.sizes.held, "sizes": stale, "fresh": {"sizes": fresh}}


def table_burst(res: dict[str, Any], repeats: int, held: int = 0, stats: str = "") -> Table:
    from rich.table import Table

    also = f", the consumer also holding {held:,} waiting timers" if held else ""
    also += f"; {stats}" if stats else ""
    t = Table(title=f"Burst: N DateTimeTriggers firing at one instant{also} (median of "
              f"{repeats} runs)")
    for col in ("N", "p50", "p99", "all applied", "reference", "x reference", "all fired",
                "statements", "runs: all applied / reference"):
        t.add_column(col, justify="right")
    for n, r in res["sizes"].items():
        t.add_row(num(int(n)), ms(r["p50"]), ms(r["p99"]), ms(r["all_applied"]),
                  ms(r["reference_all_applied"]), f"{r['ratio']:.2f}x", ms(r["fired_max"]),
                  num(r["statements"]),
                  ", ".join(f"{ms(x['all_applied'])} / {ms(x['reference_all_applied'])}"
                            for x in r["runs"]))
    t.caption = ("Latency = task_instance.updated_at (DB clock) - the trigger's instant, one "
                 "consumer + one writer; all applied = max. Reference = `bench reference`'s "
                 "bare path at the same N, run just before each burst (median of those runs). All fired = "
                 "last event_fired_at (consumer clock, same host) - instant. Statements: "
                 "pg_stat_statements calls of the consumer and writer roles from 0.3 s before "
                 "the instant until all applied.")
    return t


async def _steady_once(b: Bench, rate: int, seconds: float, *,
                       keep_held: bool = False) -> dict[str, Any]:
    if keep_held:  # the held timers stay (the million scenario's steady rate beside 1M)
        await b.db().execute("DELETE FROM task_instance WHERE state <> 'deferred'")
    else:
        await b.truncate("task_instance", "trigger")
    held = await b.owned()
    busy = await b.quiet()
    total = int(rate * seconds)
    lead = b.sizes.lead + 0.5 + total / 3000
    t0 = datetime.now(UTC) + timedelta(seconds=lead)
    run = _run_id("steady")
    b.log(f"steady: deferring {total:,} timers at {rate:,}/s from {lead:.0f}s ahead")
    await b.defer(total, run, lambda i: t0 + timedelta(seconds=i / rate))
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                             held + total, max(0.0, t0.timestamp() - time.time() - 0.6))
    if not ok:
        b.log(f"[yellow]  only {await b.owned() - held:,}/{total:,} claimed before the first "
              "instant")
    await asyncio.sleep(max(0.0, t0.timestamp() - time.time() - 0.5))
    await b.stmt_reset()
    b.log(f"steady: firing for {seconds:.0f}s")
    await asyncio.sleep(seconds)
    await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE state = 'scheduled'", total, 60, interval=0.1)
    stmts = await b.stmt_snapshot()
    lat, fired = await b.latencies(run)
    return {**dist(lat), "rate": rate, "seconds": seconds, "applied": len(lat),
            "fired_p50": pct(fired, 50), "fired_p99": pct(fired, 99),
            "machine_busy_before": busy, "held": held,
            "claimed_before": ok, "statements": b.calls(stmts),
            "stmts_per_event": b.calls(stmts) / max(1, len(lat)), "by_statement": stmts,
            "latencies": [round(x, 5) for x in lat]}


async def scenario_steady(b: Bench) -> dict[str, Any]:
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    r = await b.measured("steady", lambda: _steady_once(b, b.sizes.steady_rate,
                                                         b.sizes.steady_seconds))
    b.log(f"steady: p50 {ms(r['p50'])}, p99 {ms(r['p99'])}, {r['stmts_per_event']:.3f} "
          "statements/event")
    return r


def table_steady(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title=f"Steady rate: {res['rate']:,} fires/s for {res['seconds']:.0f} s")
    for col in ("events", "p50", "p95", "p99", "max", "fired p50", "fired p99", "statements",
                "per event"):
        t.add_column(col, justify="right")
    t.add_row(num(res["applied"]), ms(res["p50"]), ms(res["p95"]), ms(res["p99"]),
              ms(res["max"]), ms(res["fired_p50"]), ms(res["fired_p99"]),
              num(res["statements"]), f"{res['stmts_per_event']:.3f}")
    t.caption = ("Instants spread evenly (1 ms apart at 1,000/s); latency = updated_at - "
                 "instant; fired = event_fired_at - instant (the consumer's share); statements "
                 "of consumer + writer over the whole window.")
    return t


# EXPLAIN targets: statement name -> how to build its arguments from the live data.
