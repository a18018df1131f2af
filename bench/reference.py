"""The bare reference of the burst path, and the process that runs it.

One process (``python -m bench reference-worker``) does only what the event path
must do: N timers on ``loop.call_at`` fire at one instant, their events are coalesced into
confirmed publishes of ``event_batch`` each to a quorum queue, the same process consumes them
and applies each delivery with one ``UPDATE task_instance ... FROM unnest(...)``, and acks it
after the commit. No claims, leases, fencing, trigger rows or codecs. Its all-applied time
is the yardstick every burst is printed against, measured in the same run and interleaved
with the bursts, because this machine's speed varies by 2x from day to day.
"""


from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, dist, median_of, ms, pct

if TYPE_CHECKING:
    from rich.table import Table

    from bench.harness import Bench

APPLY = """
UPDATE task_instance ti SET state = 'scheduled',
    next_kwargs = coalesce(ti.next_kwargs, '{}'::jsonb) || jsonb_build_object('event', e.payload::jsonb),
    event_fired_at = to_timestamp(e.fired_at), event_applied_at = clock_timestamp(),
    updated_at = clock_timestamp()
FROM unnest($1::bigint[], $2::text[], $3::float8[]) AS e(id, payload, fired_at)
WHERE ti.id = e.id AND ti.state = 'deferred'
"""


def reference_queue(b: Bench) -> str:
    return f"{b.namespace}.reference"


async def reference_once(b: Bench, n: int, rate: float = 0.0) -> dict[str, Any]:
    """One reference burst of ``n``: its latencies from the database, like a burst's. With
    ``rate``, the instants are spread ``1 / rate`` apart instead (a steady rate's reference)."""
    from bench.harness import _run_id

    run = _run_id(f"ref{n}")
    await b.db().execute(
        "INSERT INTO task_instance (dag_id, task_id, run_id, state, next_method, next_kwargs) "
        "SELECT 'bench', 'r' || g, $1, 'deferred', 'execute', '{}'::jsonb "
        "FROM generate_series(1, $2) g", run, n)
    busy = await b.quiet()
    # The worker sets its instant itself once it has imported, connected, read its ids and
    # warmed up: on a loaded machine that takes longer than any fixed lead.
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench", "reference-worker", "--run-id", run,
        "--queue", reference_queue(b), "--lead", str(1.0 + n / 20_000), "--rate", str(rate),
        env=b.env("writer"), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await worker.communicate()
    if worker.returncode != 0:
        raise BenchError(f"reference worker failed: {stderr.decode()[-2000:]}")
    report = json.loads(stdout.decode().strip().splitlines()[-1])
    lat, fired = await b.latencies(run)
    await b.db().execute("DELETE FROM task_instance WHERE run_id = $1", run)
    if len(lat) != n:
        raise BenchError(f"reference applied {len(lat):,} of {n:,}")
    d = dist(lat)
    return {**d, "all_applied": d["max"], "applied": len(lat), "fired_max": max(fired),
            "fired_p50": pct(fired, 50), "statements": report["statements"],
            "machine_busy_before": busy}


async def reference_run(b: Bench, n: int) -> dict[str, Any]:
    """A reference burst of ``n``, recorded on the bench so every scenario of the run can
    quote the median of all reference runs of that size."""
    r = await b.measured(f"reference {n}", lambda: reference_once(b, n))
    b.reference.setdefault(n, []).append(r)
    b.log(f"reference: N={n:,}: all applied {ms(r['all_applied'])}")
    return r


async def scenario_reference(b: Bench) -> dict[str, Any]:
    """The reference alone, median of repeats, at each burst size of this run."""
    await b.reset()
    sizes = sorted({*b.sizes.burst, *b.sizes.held_burst})
    for n in sizes:
        for _ in range(b.sizes.repeats):
            await reference_run(b, n)
    return {"sizes": {str(n): reference_summary(b, n) for n in sizes}}


def reference_summary(b: Bench, n: int) -> dict[str, Any]:
    runs = b.reference.get(n, [])
    return {"runs": [{k: v for k, v in r.items() if k != "latencies"} for r in runs],
            **{k: median_of(runs, k) for k in ("p50", "p99", "all_applied", "fired_max")}}


def table_reference(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title="Reference: the bare burst path in one process (call_at timers -> "
              "confirmed publishes -> one UPDATE ... FROM unnest() per delivery -> ack)")
    for col in ("N", "p50", "p99", "all applied (median)", "all fired", "runs: all applied"):
        t.add_column(col, justify="right")
    for n, r in res["sizes"].items():
        t.add_row(f"{int(n):,}", ms(r["p50"]), ms(r["p99"]), ms(r["all_applied"]),
                  ms(r["fired_max"]), ", ".join(ms(x["all_applied"]) for x in r["runs"]))
    t.caption = ("Same clocks as the bursts: task_instance.updated_at (DB) - instant; "
                 "event_batch events per message, prefetch 400, one statement per delivery, two connections.")
    return t


# ----------------------------------------------------------------------------- the worker


async def _worker(run_id: str, queue: str, lead: float, rate: float) -> dict[str, Any]:
    import aio_pika
    import asyncpg
    import msgspec

    from triggerflow.settings import Settings

    settings = Settings()
    # aio-pika runs each delivery's callback as its own task: two connections let one
    # statement commit while the next runs, as the writer overlaps filling and applying
    db = await asyncpg.create_pool(settings.database_dsn(), min_size=2, max_size=2)
    ids = [r["id"] for r in await db.fetch(
        "SELECT id FROM task_instance WHERE run_id = $1 ORDER BY id", run_id)]
    conn = await aio_pika.connect(settings.amqp_dsn())
    pub = await conn.channel(publisher_confirms=True)
    sub = await conn.channel()
    await sub.set_qos(prefetch_count=settings.writer_prefetch)
    q = await sub.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
    payload = json.dumps("")  # the instant's, once it is set
    payload_of: dict[int, str] = {}  # each id's own instant when they are spread (rate)
    done = asyncio.Event()
    warm = asyncio.Event()
    applied = 0
    statements = 0

    async def on_delivery(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal applied, statements
        batch_ids, fired = msgspec.msgpack.decode(message.body)
        payloads = ([payload_of[i] for i in batch_ids] if payload_of
                    else [payload] * len(batch_ids))
        await db.execute(APPLY, batch_ids, payloads, fired)
        await message.ack()
        if not batch_ids:
            warm.set()
            return
        statements += 1
        applied += len(batch_ids)
        if applied >= len(ids):
            done.set()

    await q.consume(on_delivery)
    loop = asyncio.get_running_loop()
    pending: list[tuple[int, float]] = []
    publishes: set[asyncio.Task[None]] = set()

    async def publish(chunk: list[tuple[int, float]]) -> None:
        body = msgspec.msgpack.encode(([i for i, _ in chunk], [f for _, f in chunk]))
        await pub.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=queue, mandatory=True)

    def flush() -> None:
        while pending:
            chunk = pending[:settings.event_batch]
            del pending[:settings.event_batch]
            task = loop.create_task(publish(chunk))
            publishes.add(task)
            task.add_done_callback(publishes.discard)

    # Spread instants (a steady rate) linger as the consumer's events do (event_linger), so
    # the reference's messages and statements are as few as the real path's; a burst's
    # timers all fire in one loop pass and need no linger.
    linger = settings.event_linger.total_seconds() if rate else 0.0

    def fire(trigger_id: int) -> None:
        if not pending:  # every timer due meanwhile joins the same flush
            loop.call_later(linger, flush)
        pending.append((trigger_id, time.time()))

    # Warm up as a long-running writer is: statements prepared and catalogs cached on both
    # connections, the publish channel and the consumer used once.
    async with db.acquire() as c1, db.acquire() as c2:
        await asyncio.gather(*(c.execute(APPLY, [], [], []) for c in (c1, c2)))
    await publish([])
    await asyncio.wait_for(warm.wait(), timeout=30)
    instant = time.time() + lead
    payload = json.dumps(datetime.fromtimestamp(instant, UTC).isoformat())
    at = loop.time() + lead
    for k, i in enumerate(ids):
        step = k / rate if rate else 0.0
        if rate:
            payload_of[i] = json.dumps(datetime.fromtimestamp(instant + step, UTC).isoformat())
        loop.call_at(at + step, fire, i)
    await asyncio.wait_for(done.wait(), timeout=120 + (len(ids) / rate if rate else 0))
    await conn.close()
    await db.close()
    return {"instant": instant, "applied": applied, "statements": statements}


def _worker_main(argv: list[str]) -> int:
    import argparse

    import uvloop

    p = argparse.ArgumentParser(prog="bench reference-worker")
    p.add_argument("--run-id", required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--lead", type=float, required=True)
    p.add_argument("--rate", type=float, default=0.0)
    args = p.parse_args(argv)
    print(json.dumps(uvloop.run(_worker(args.run_id, args.queue, args.lead, args.rate))))
    return 0
