"""Scenario million: a million waiting timers in one consumer (issue 11).

The rows are seeded in SQL (one SDK deferral is the template, cloned with
``generate_series``) and their wake-ups queued before the consumer starts, so what is timed
is the consumer's claim, not the SDK. In order:

- periodic database time per second (consumer + writer) at the smaller levels (10k, 100k);
- one consumer claims ``million`` timers: claim time, RSS per timer against a fresh empty
  consumer, CPU, statements/s and periodic database time while they wait;
- a steady 1,000 fires/s beside them, and the bare reference at the same rate;
- a peer starts, the holder is SIGKILLed: time until the peer owns and runs every one.
"""


from __future__ import annotations

import asyncio
import math
import signal
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, Proc, _proc_rss, cpu_percent, ms, num
from bench.harness import Bench, _run_id
from bench.reference import reference_once
from bench.scenarios import _steady_once

if TYPE_CHECKING:
    from rich.table import Table

# Clone the template deferral ($1, a trigger id) into $3 more trigger rows and their deferred
# tasks (task ids t$2, t$2+1, ...), exactly as DEFER writes them.
SEED = """
WITH t AS (
    INSERT INTO trigger (classpath, kwargs, queue, timeout_at, traceparent)
    SELECT classpath, kwargs, queue, timeout_at, traceparent
    FROM trigger, generate_series(1, $3) WHERE id = $1
    RETURNING id
), numbered AS (
    SELECT id, $2 - 1 + row_number() OVER (ORDER BY id) AS i FROM t
)
INSERT INTO task_instance (dag_id, task_id, run_id, map_index, state, queue, next_method,
                           next_kwargs, trigger_id, trigger_timeout, start_date, updated_at)
SELECT ti.dag_id, 't' || n.i, ti.run_id, ti.map_index, ti.state, ti.queue, ti.next_method,
       ti.next_kwargs, n.id, ti.trigger_timeout, ti.start_date, clock_timestamp()
FROM numbered n, task_instance ti WHERE ti.trigger_id = $1
"""
CHUNK = 100_000  # rows per seeding statement


async def seed(b: Bench, n: int, run_id: str) -> list[int]:
    """``n`` far timers deferred as the SDK would, in SQL; returns the ids not yet sent."""
    await b.defer(1, run_id)  # the template (its wake-up is already sent)
    template = int(await b.db().fetchval(
        "SELECT trigger_id FROM task_instance WHERE run_id = $1", run_id))
    for lo in range(1, n, CHUNK):
        await b.db().execute(SEED, template, lo, min(CHUNK, n - lo))
        if lo // CHUNK % 3 == 2:
            b.log(f"  seeded {min(n, lo + CHUNK):,}/{n:,}")
    rows = await b.db().fetch(
        "SELECT trigger_id FROM task_instance WHERE run_id = $1 AND trigger_id <> $2 "
        "ORDER BY trigger_id", run_id, template)
    return [r[0] for r in rows]


async def send(b: Bench, ids: list[int]) -> None:
    """Queue the wake-ups the SDK would have sent (1,000 ids a message)."""
    assert b.broker is not None
    await b.broker.publish_wakeups({b.queue: ids})


def _capacity(b: Bench) -> dict[str, Any]:
    # room for the million, the steady rate's timers and a margin (default capacity: 200k)
    return {"capacity": int(b.sizes.million * 1.2) + b.sizes.steady_rate * 60}


async def _window(b: Bench, proc: Proc) -> dict[str, Any]:
    """CPU and statements of the waiting consumer (and the writer) over one window."""
    await b.stmt_reset()
    cpu = (await cpu_percent([proc.pid], b.sizes.million_window))[0]
    stmts = await b.stmt_snapshot()
    window = b.sizes.million_window
    roles = ("consumer", "writer")
    return {"window_s": window, "cpu_pct": cpu,
            "db_ms_per_s": sum(s["total_ms"] for s in stmts if s["role"] in roles) / window,
            "stmts_per_s": {r: sum(s["calls"] for s in stmts if s["role"] == r) / window
                            for r in roles},
            "by_statement": stmts}


async def _claimed(b: Bench, proc: Proc, n: int) -> float:
    """Seconds from the consumer's registration (DB clock) until it owns all ``n``."""
    ok, t_all = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                                 n, 900, interval=0.2)
    reg = await b.db().fetchval(
        "SELECT extract(epoch FROM started_at)::float8 FROM consumer WHERE pid = $1", proc.pid)
    if not ok or reg is None:
        raise BenchError(f"the consumer claimed only {await b.owned():,} of {n:,}; "
                         f"see {proc.log}")
    # running = what the runner holds, reported by the next renewals
    await b.wait_for("SELECT coalesce(max(running), 0) FROM consumer WHERE pid = $1", n, 60,
                     proc.pid, interval=0.2)
    await _drained(b)
    return float(t_all - reg)


async def _drained(b: Bench, within: float = 300) -> None:
    """Wait until no wake-up is left on the queue: a backlog claimed for longer than the
    unclaimed grace has some ids re-sent by the reaper meanwhile, and the claims of those
    duplicates (which find them owned) are no part of waiting."""
    assert b.broker is not None
    deadline = asyncio.get_running_loop().time() + within
    while asyncio.get_running_loop().time() < deadline:
        info = await b.broker.queue_info(b.queue)
        if info is None or info.ready == 0:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(b.sizes.settle)  # the last prefetched ones


async def _level(b: Bench, n: int) -> dict[str, Any]:
    """Periodic cost while one consumer holds ``n`` (a smaller level than the million)."""
    await b.reset()
    await b.start_writer()
    ids = await seed(b, n, _run_id("level"))
    await send(b, ids)
    proc = await b.start_consumer(ready=False, **_capacity(b))
    await _claimed(b, proc, n)
    await b.analyze(vacuum=True)  # the steady state: autovacuum has been by
    await asyncio.sleep(b.sizes.settle)
    busy = await b.quiet()
    b.log(f"million: {n:,} held; measuring {b.sizes.million_window:.0f}s")
    return {"held": n, "machine_busy_before": busy, **await _window(b, proc)}


async def _failover(b: Bench, victim: Proc) -> dict[str, Any]:
    total = await b.db().fetchval("SELECT count(*) FROM trigger")
    peer = await b.start_consumer(**_capacity(b))
    vid, pid_ = await b.consumer_id(victim), await b.consumer_id(peer)
    held = await b.owned(vid)
    t0 = float(await b.db().fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))
    victim.popen.send_signal(signal.SIGKILL)
    b.log(f"million: SIGKILL of the consumer holding {held:,}; its peer takes over")
    within = max(b.sizes.failover_timeout, total / 2_000)  # a number even when it misses
    owned, t_owned = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id = $1", total,
                                      within, pid_, interval=0.2)
    running, t_running = await b.wait_for(
        "SELECT coalesce(max(running), 0) FROM consumer WHERE id = $1", total,
        within if owned else 0, pid_, interval=0.2)
    freed = await b.db().fetchval(
        "SELECT extract(epoch FROM min(dispatched_at))::float8 FROM trigger "
        "WHERE dispatched_at > to_timestamp($1)", t0)
    await b.stop(victim, signal.SIGKILL)
    return {"held": held, "total": total, "complete": owned and running,
            "owned_s": t_owned - t0, "running_s": t_running - t0,
            "freed_after_s": (freed - t0) if freed else math.nan,
            "peer_owned": await b.owned(pid_)}


async def scenario_million(b: Bench) -> dict[str, Any]:
    n = b.sizes.million
    levels = [await _level(b, k) for k in b.sizes.million_periodic]
    await b.reset()
    await b.start_writer()
    empty = await b.start_consumer(**_capacity(b))
    await asyncio.sleep(b.sizes.settle)
    base_rss = _proc_rss(empty.pid)
    await b.stop(empty)
    await b.truncate("consumer")
    b.log(f"million: seeding {n:,} waiting timers")
    ids = await seed(b, n, _run_id("million"))
    await send(b, ids)
    del ids
    busy = await b.quiet()
    proc = await b.start_consumer(ready=False, **_capacity(b))
    claim_s = await _claimed(b, proc, n)
    b.log(f"million: {n:,} claimed and running in {claim_s:.1f}s")
    await b.analyze(vacuum=True)  # the steady state: autovacuum has been by
    await asyncio.sleep(b.sizes.settle)
    rss = _proc_rss(proc.pid)
    held = {"held": n, "machine_busy_before": busy, **await _window(b, proc)}
    levels.append(held)
    b.log(f"million: {(rss - base_rss) / n:.0f} B/timer, CPU {held['cpu_pct']:.2f}%, "
          f"{held['stmts_per_s']['consumer']:.2f} statements/s")
    rate, seconds = b.sizes.steady_rate, b.sizes.steady_seconds
    ref = await b.measured("steady reference", lambda: reference_once(
        b, int(rate * seconds), rate))
    steady = await b.measured("steady beside the million", lambda: _steady_once(
        b, rate, seconds, keep_held=True))
    b.log(f"million: steady {rate:,}/s: p50 {ms(steady['p50'])}, p99 {ms(steady['p99'])} "
          f"(reference p50 {ms(ref['p50'])}, p99 {ms(ref['p99'])})")
    failover = await _failover(b, proc)
    b.log(f"million: all {failover['total']:,} owned by the peer after "
          f"{failover['owned_s']:.1f}s, running after {failover['running_s']:.1f}s")
    await b.stop_all()
    return {"n": n, "base_rss": base_rss, "rss": rss, "bytes_per_timer": (rss - base_rss) / n,
            "claim_s": claim_s, "claim_rate": n / claim_s, "levels": levels,
            "steady": {k: v for k, v in steady.items() if k != "latencies"},
            "reference": ref, "failover": failover}


def million_checks(res: dict[str, Any]) -> list[tuple[str, str, str, str, bool]]:
    """(target key, metric, value, target text, met) of the scenario's results."""
    from bench.common import TARGETS

    big = res["levels"][-1]
    per_s = [lv["db_ms_per_s"] for lv in res["levels"]]
    st, ref, fo = res["steady"], res["reference"], res["failover"]
    rows = [
        ("million_kb", f"RSS per waiting timer (N={res['n']:,})",
         f"{res['bytes_per_timer']:.0f} B", res["bytes_per_timer"] <= 512),
        ("million_cpu", f"CPU while {res['n']:,} wait", f"{big['cpu_pct']:.2f} %",
         big["cpu_pct"] <= 2.0),
        ("million_stmts", f"consumer statements/s while {res['n']:,} wait",
         f"{big['stmts_per_s']['consumer']:.2f}", big["stmts_per_s"]["consumer"] <= 2.0),
        ("million_periodic", "periodic DB time/s at " + " / ".join(
            num(lv["held"]) for lv in res["levels"]) + " held",
         " / ".join(f"{x:.3f} ms" for x in per_s), max(per_s) <= 2 * min(per_s)),
        ("million_steady", f"steady {st['rate']:,}/s beside {res['n']:,}: p50 / p99 "
         "(reference p50 / p99)",
         f"{ms(st['p50'])} / {ms(st['p99'])} ({ms(ref['p50'])} / {ms(ref['p99'])}; "
         f"{st['p99'] / ref['p99']:.2f}x at p99)",
         st["p50"] <= 0.005 and st["p99"] <= 0.020),
        ("million_failover", f"SIGKILL: all {fo['total']:,} running on the peer",
         ms(fo["running_s"]), bool(fo["complete"]) and fo["running_s"] <= 30),
    ]
    return [(key, what, value, TARGETS[key][0], ok) for key, what, value, ok in rows]


def table_million(res: dict[str, Any]) -> Table:
    from rich.table import Table

    judged = res["n"] >= 1_000_000
    t = Table(title=f"Million: one consumer holding {res['n']:,} waiting timers (issue 11)")
    for col in ("metric", "value", "target", ""):
        t.add_column(col)
    t.add_row(f"claim+start all {res['n']:,}", f"{ms(res['claim_s'])} "
              f"({num(res['claim_rate'])} /s)", "-", "")
    t.add_row("RSS empty / with N", f"{res['base_rss'] / 2**20:.1f} MiB / "
              f"{res['rss'] / 2**20:.1f} MiB", "-", "")
    for _, what, value, target, ok in million_checks(res):
        verdict = ("[green]met" if ok else "[bold red]missed") if judged else "-"
        t.add_row(what, value, target, verdict)
    fo = res["failover"]
    t.add_row("SIGKILL: freed / all owned by the peer", f"{ms(fo['freed_after_s'])} / "
              f"{ms(fo['owned_s'])}", "-", "")
    t.caption = (
        "RSS per timer = (VmRSS holding N - VmRSS of a fresh empty consumer) / N; CPU, "
        "statements and DB time (pg_stat_statements total_exec_time of consumer + writer) "
        f"over {res['levels'][-1]['window_s']:.0f} s of waiting after VACUUM ANALYZE (what "
        "autovacuum does after the mass claim). Steady: "
        "updated_at - instant of timers 1/rate apart beside the N; reference = the bare path "
        "(`bench reference`'s worker) at the same rate, same run. Failover: from the SIGKILL "
        "(DB clock) until the peer owns every trigger, then until its renewal reports them "
        "running." + ("" if judged else " Judged only at 1,000,000."))
    return t
