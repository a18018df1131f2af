"""Scenario dbload: statements while waiting, EXPLAIN of the hot statements, writer throughput."""


from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, _Rollback, cpu_percent, num
from bench.harness import Bench, _run_id
from bench.scenarios import _burst_once, _steady_once

if TYPE_CHECKING:
    from rich.table import Table

HOT = ("CLAIM", "RENEW", "REAP_DEAD", "REAP_DEAD (a dead owner)", "RESEND_UNCLAIMED",
       "TIMEOUT_ORPHANS",
       "TIMEOUT_ORPHANS (writer)", "SWEEP_CANCELLED", "APPLY_EVENTS", "DEFER")


async def _explain_all(b: Bench, me: int) -> list[dict[str, Any]]:
    from triggerflow.store.postgres.statements import claims, deferral, lease, reaper, writer
    from triggerflow.wire import encode_json

    db = b.db()
    idle_ids = [r["id"] for r in await db.fetch(
        "SELECT id FROM trigger WHERE queue = $1 ORDER BY id LIMIT 2000", b.idle_queue)]
    owned = await db.fetch(
        "SELECT id, attempt, queue FROM trigger WHERE owner_id = $1 ORDER BY random() LIMIT 500",
        me)
    owned = sorted(owned, key=lambda r: r["id"])
    moment = encode_json(datetime.now(UTC))
    k = 1000
    uid = uuid.uuid4().hex[:8]
    args: dict[str, tuple[str, tuple[Any, ...]]] = {
        "CLAIM": (claims.CLAIM, (me, idle_ids, [b.idle_queue])),
        "RENEW": (lease.NATIVE.renew, (me, 3.0, 100_000, [b.queue], True)),
        "REAP_DEAD": (reaper.REAP_DEAD, ([b.queue], False, 10)),
        # the consumer's lease expires inside the rolled-back transaction: what a peer's
        # reaper runs once after a crash, freeing everything it held
        "REAP_DEAD (a dead owner)": (reaper.REAP_DEAD, ([b.queue], False, 10)),
        "RESEND_UNCLAIMED": (reaper.RESEND_UNCLAIMED, ([b.queue], False, 15.0, 20_000)),
        "TIMEOUT_ORPHANS": (reaper.TIMEOUT_ORPHANS, ([b.queue], False, 7 * 86400.0)),
        "TIMEOUT_ORPHANS (writer)": (reaper.TIMEOUT_ORPHANS, ([], True, 7 * 86400.0)),
        "SWEEP_CANCELLED": (claims.SWEEP_CANCELLED, (me,)),
        "APPLY_EVENTS": (writer.APPLY_EVENTS, (
            [r["id"] for r in owned], [r["attempt"] for r in owned], [r["queue"] for r in owned],
            ["resume"] * len(owned), [moment] * len(owned), [time.time()] * len(owned))),
        "DEFER": (deferral.DEFER, (
            ["bench"] * k, [f"x{i}" for i in range(k)], [f"explain-{uid}"] * k, [-1] * k,
            ["triggerflow.triggers.temporal.DateTimeTrigger"] * k,
            [json.dumps({"moment": "2030-01-01T00:00:00+00:00"})] * k, [b.queue] * k,
            ["execute_complete"] * k, ["{}"] * k, [604800.0] * k, [None] * k)),
    }
    out = []
    for name in HOT:
        sql, params = args[name]
        plan: list[str] = []
        for _ in range(2):  # the second run is the warm one we keep
            try:
                async with db.acquire() as conn, conn.transaction():
                    if name == "REAP_DEAD (a dead owner)":
                        await conn.execute("UPDATE consumer SET expires_at = now() - "
                                           "interval '1 second' WHERE id = $1", me)
                    rows = await conn.fetch("EXPLAIN (ANALYZE, BUFFERS) " + sql, *params)
                    plan = [r[0] for r in rows]
                    raise _Rollback
            except _Rollback:
                pass
        text = "\n".join(plan)
        ran = "\n".join(line for line in plan if "never executed" not in line)
        indexes = sorted(set(re.findall(r"(?:Index Scan|Index Only Scan|Bitmap Index Scan)"
                                        r"(?: Backward)? (?:using|on) (\w+)", ran)))
        seqs = sorted(set(re.findall(r"Seq Scan on (\w+)", ran)))
        exec_ms = re.search(r"Execution Time: ([\d.]+) ms", text)
        hits = sum(int(x) for x in re.findall(r"shared hit=(\d+)", plan[0] if plan else ""))
        out.append({"statement": name, "exec_ms": float(exec_ms.group(1)) if exec_ms else None,
                    "indexes": indexes, "seq_scans": seqs, "top_buffers_hit": hits,
                    "plan": plan})
    return out


async def _writer_rate(b: Bench, writers: int, run: str, limit: int) -> dict[str, Any]:
    """Publish one event for each of the first ``limit`` tasks still deferred in ``run``, with
    ``writers`` writers running; time until all are applied."""
    from triggerflow.wire import Event, encode_events, encode_json

    assert b.broker is not None
    ids = [(r["id"], r["attempt"]) for r in await b.db().fetch(
        "SELECT t.id, t.attempt FROM trigger t JOIN task_instance ti ON ti.trigger_id = t.id"
        " WHERE ti.run_id = $1 ORDER BY t.id", run)]
    ids = ids[:limit]
    procs = [await b.start_writer() for _ in range(writers)]
    payload = encode_json(datetime.now(UTC))
    batches = [ids[i:i + 500] for i in range(0, len(ids), 500)]
    await b.quiet()
    await b.stmt_reset()
    t0 = time.time()
    await asyncio.gather(*(b.broker.publish(
        b.broker.topology.events, b.queue,
        encode_events([Event(tid, att, b.queue, "resume", payload, time.time())
                       for tid, att in part]))
        for part in batches))
    publish_s = time.time() - t0
    done, _ = await b.wait_for(
        "SELECT count(*) FROM task_instance WHERE run_id = $1 AND state = 'scheduled' "
        "AND event_fired_at >= to_timestamp($2)", len(ids), 180, run, t0, interval=0.1)
    last = await b.db().fetchval(
        "SELECT extract(epoch FROM max(updated_at))::float8 FROM task_instance "
        "WHERE run_id = $1 AND state = 'scheduled' AND event_fired_at >= to_timestamp($2)",
        run, t0)
    stmts = await b.stmt_snapshot()
    for p in procs:
        await b.stop(p)
    elapsed = last - t0
    applies = sum(s["calls"] for s in stmts if s["statement"] == "APPLY_EVENTS")
    return {"writers": writers, "events": len(ids), "applied_all": done, "seconds": elapsed,
            "events_per_s": len(ids) / elapsed, "publish_s": publish_s,
            "apply_statements": applies, "statements": b.calls(stmts)}


async def scenario_dbload(b: Bench) -> dict[str, Any]:
    s = b.sizes
    out: dict[str, Any] = {}
    # 1. Statements per second per process while many triggers wait.
    await b.reset()
    writer = await b.start_writer()
    consumer = await b.start_consumer()
    me = await b.consumer_id(consumer)
    b.log(f"dbload: deferring {s.waiting:,} waiting timers (+2,000 to a queue nobody consumes)")
    await b.defer(s.waiting, _run_id("wait"))
    await b.defer(2_000, _run_id("idle"), queue=b.idle_queue)
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL",
                             s.waiting, 300)
    if not ok:
        raise BenchError("consumer did not claim every waiting trigger")
    await asyncio.sleep(b.sizes.settle)
    await b.analyze()  # as autovacuum would have by now on a long-running system
    await b.quiet()
    b.log(f"dbload: {s.waiting:,} waiting; counting statements for {s.idle_window:.0f}s")
    await b.stmt_reset()
    cpu = await cpu_percent([consumer.pid, writer.pid], s.idle_window)
    idle = await b.stmt_snapshot()
    window = s.idle_window
    per_role = {role: sum(x["calls"] for x in idle if x["role"] == role) / window
                for role in ("consumer", "writer", "all")}
    out["idle"] = {"waiting": s.waiting, "window_s": window, "per_s": per_role,
                   "cpu_pct": {"consumer": cpu[0], "writer": cpu[1]}, "by_statement": idle}
    b.log(f"dbload: while waiting: consumer {per_role['consumer']:.2f}/s, writer "
          f"{per_role['writer']:.2f}/s")
    # 2. EXPLAIN (ANALYZE, BUFFERS) of the hot statements against this data.
    b.log("dbload: EXPLAIN ANALYZE of the hot statements")
    out["explain"] = await _explain_all(b, me)
    # 3. Statements per fired event: a burst and a steady rate (fresh processes, no backlog).
    await b.reset()
    await b.start_writer()
    await b.start_consumer()
    b.log(f"dbload: burst of {s.dbload_burst:,}")
    burst = await b.measured("burst", lambda: _burst_once(b, s.dbload_burst))
    burst.pop("latencies")
    out["burst"] = burst
    steady = await b.measured("steady", lambda: _steady_once(b, s.steady_rate,
                                                             s.dbload_steady_seconds))
    steady.pop("latencies")
    out["steady"] = steady
    # 4. Writer throughput: 1 writer right after the deferrals (planner statistics stale, as
    # after any big batch of deferrals), then 1 and 2 writers once the tables are analyzed.
    await b.reset()
    n = s.writer_events
    out["writers"] = []
    cases = (("stale", 1), ("analyzed", 1), ("analyzed", 2))
    for i, (stats, writers) in enumerate(cases):
        if i < 2:
            run = _run_id(f"w{i}")
            b.log(f"dbload: writer throughput: deferring {n:,} tasks")
            await b.defer(n if i == 0 else 2 * n, run)
            await b.purge()  # no consumer: the events below are what a consumer would publish
            if stats == "analyzed":
                await b.analyze()
        r = await _writer_rate(b, writers, run, n)
        r["stats"] = stats
        out["writers"].append(r)
        b.log(f"dbload: {writers} writer(s), statistics {stats}: {r['events_per_s']:,.0f} "
              "events/s")
    return out


def tables_dbload(res: dict[str, Any]) -> list[Table]:
    from rich.markup import escape
    from rich.table import Table

    idle = res["idle"]
    t1 = Table(title=f"Database load while {idle['waiting']:,} timers wait "
               f"({idle['window_s']:.0f} s window)")
    for col in ("process", "statement", "calls", "per second", "mean ms"):
        t1.add_column(col, justify="right" if col not in ("process", "statement") else "left")
    rows = sorted(idle["by_statement"], key=lambda x: (x["role"], -x["calls"]))
    for x in rows:
        t1.add_row(x["role"], escape(x["statement"]), num(x["calls"]),
                   f"{x['calls'] / idle['window_s']:.2f}", f"{x['total_ms'] / x['calls']:.2f}")
    for role in ("consumer", "writer"):
        if role in idle["per_s"]:
            t1.add_row(f"[b]{role}", "[b]total", "", f"[b]{idle['per_s'][role]:.2f}", "")
    t1.caption = ("pg_stat_statements calls per database role: the consumer and the writer log "
                  "in as their own roles, so each line is one process (one consumer, one writer).")
    t2 = Table(title="Statements per fired event")
    for col in ("case", "events", "consumer", "writer", "total", "per event"):
        t2.add_column(col, justify="right")
    for name, r in (("burst", res["burst"]), ("steady", res["steady"])):
        label = (f"burst of {r['applied']:,}" if name == "burst" else
                 f"steady {r['rate']:,}/s x {r['seconds']:.0f} s")
        by = r["by_statement"]
        t2.add_row(label, num(r["applied"]), num(Bench.calls(by, ("consumer",))),
                   num(Bench.calls(by, ("writer",))), num(r["statements"]),
                   f"{r['stmts_per_event']:.4f}")
    t3 = Table(title="Writer throughput (events published all at once, 500 per message)")
    for col in ("writers", "planner statistics", "events", "seconds", "events/s",
                "APPLY_EVENTS calls", "statements"):
        t3.add_column(col, justify="right")
    for r in res["writers"]:
        t3.add_row(str(r["writers"]), r.get("stats", "-"), num(r["events"]),
                   f"{r['seconds']:.2f}", num(r["events_per_s"]), num(r["apply_statements"]),
                   num(r["statements"]))
    t3.caption = ("seconds = first publish → last task_instance.updated_at (DB clock). Stale: "
                  "the tasks were deferred just before (autovacuum has not analyzed them yet, as "
                  "after any large batch of deferrals); analyzed: after ANALYZE.")
    t4 = Table(title="Hot statements: EXPLAIN (ANALYZE, BUFFERS) against the waiting data")
    for col in ("statement", "execution", "indexes used", "seq scans"):
        t4.add_column(col, justify="left")
    for r in res["explain"]:
        t4.add_row(r["statement"], f"{r['exec_ms']:.2f} ms" if r["exec_ms"] is not None else "-",
                   ", ".join(r["indexes"]) or "-", ", ".join(r["seq_scans"]) or "-")
    return [t1, t2, t3, t4]
