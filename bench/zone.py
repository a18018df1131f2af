"""Scenario zone: half of a team's consumers (a zone) SIGKILLed at once while they hold their
share of N waiting timers; the survivors take over up to their capacity, the rest wait in the
team queue, and a replacement consumer takes those.

Four consumers with ``capacity`` = 40 % of N each (so four hold N with room, two cannot):
after the kill the two survivors fill up to 2 x 40 % = 80 % of N and the last 20 % stay in
the queue, unclaimed but not lost, until the replacement starts. N is ``--zone-triggers``
(100,000 by default).
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, ms, num
from bench.harness import _run_id

if TYPE_CHECKING:
    from rich.table import Table

    from bench.common import Proc
    from bench.harness import Bench

CONSUMERS = 4
CAPACITY_SHARE = 0.4  # of N, per consumer

HELD = "SELECT owner_id, count(*) AS n FROM trigger WHERE owner_id = ANY($1) GROUP BY 1"


async def _hold(b: Bench, ids: list[int], target: int, within: float) -> tuple[float, int]:
    """Poll until ``ids`` own ``target`` triggers together: (seconds, the most any one held)."""
    t0, most = time.monotonic(), 0
    while time.monotonic() - t0 < within:
        rows = await b.db().fetch(HELD, ids)
        most = max([most, *(r["n"] for r in rows)])
        if sum(r["n"] for r in rows) >= target:
            return time.monotonic() - t0, most
        await asyncio.sleep(0.1)
    raise BenchError(f"consumers {ids} did not hold {target:,} triggers within {within:.0f}s")


async def _spread(b: Bench, ids: list[int], n: int, within: float) -> None:
    """Wait until the zone holds about its share (rebalancing moves triggers to new peers)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = await b.db().fetch(HELD, ids)
        if len(rows) == len(ids) and min(r["n"] for r in rows) >= 0.8 * n / CONSUMERS:
            return
        await asyncio.sleep(0.5)


async def scenario_zone(b: Bench) -> dict[str, Any]:
    n = b.sizes.zone
    cap = int(n * CAPACITY_SHARE)
    await b.reset()
    procs: list[Proc] = [await b.start_consumer(capacity=cap) for _ in range(CONSUMERS)]
    ids = [await b.consumer_id(p) for p in procs]
    t = time.monotonic()
    await b.defer(n, _run_id("zone"))
    await _hold(b, ids, n, b.sizes.failover_timeout * 2)
    b.log(f"zone: {n:,} timers deferred and claimed in {time.monotonic() - t:.1f}s")
    await _spread(b, ids, n, 60)
    zone, survivors = procs[: CONSUMERS // 2], procs[CONSUMERS // 2 :]
    zone_ids, survivor_ids = ids[: CONSUMERS // 2], ids[CONSUMERS // 2 :]
    held_by_zone = sum(r["n"] for r in await b.db().fetch(HELD, zone_ids))
    for proc in zone:  # at once: the zone's hosts vanish together
        proc.popen.send_signal(signal.SIGKILL)
    full = min(n, cap * len(survivors))
    took, most = await _hold(b, survivor_ids, full, b.sizes.failover_timeout)
    await asyncio.sleep(b.sizes.settle)  # do the survivors stay within capacity?
    rows = await b.db().fetch(HELD, survivor_ids)
    most = max([most, *(r["n"] for r in rows)])
    assert b.broker is not None
    info = await b.broker.queue_info(b.queue)
    messages = info[0] if info else -1  # a wake-up message carries up to 1,000 trigger ids
    waiting = n - sum(r["n"] for r in rows)
    b.log(f"zone: {held_by_zone:,} on the killed consumers; survivors hold {full:,} after "
          f"{took:.2f}s (at most {most:,} each, capacity {cap:,}); {waiting:,} triggers wait "
          f"({messages:,} wake-up messages ready in the queue)")
    replaced = float("nan")
    if full < n:
        t = time.monotonic()
        # not start_consumer's readiness: the survivors, at capacity, are not subscribed
        new = await b.start_consumer(capacity=cap, ready=False)
        await b.wait_ready(new, b.queue, 1, within=120)
        await _hold(b, [*survivor_ids, await b.consumer_id(new)], n, b.sizes.failover_timeout)
        replaced = time.monotonic() - t
        b.log(f"zone: all {n:,} running again {replaced:.2f}s after the replacement started")
    for proc in zone:
        await b.stop(proc, signal.SIGKILL)
    await b.stop_all()
    return {"n": n, "capacity": cap, "held_by_zone": held_by_zone, "survivors_full_s": took,
            "survivors_hold": full, "most_per_survivor": most, "waiting": waiting,
            "queue_messages": messages,
            "all_running_after_replacement_s": replaced}


def table_zone(res: dict[str, Any]) -> Table:
    from rich.table import Table

    t = Table(title=f"A zone lost: 2 of {CONSUMERS} consumers SIGKILLed at once, "
              f"{res['n']:,} timers held, capacity {res['capacity']:,} per consumer")
    t.add_column("")
    t.add_column("value", justify="right")
    t.add_row("held by the killed consumers", num(res["held_by_zone"]))
    t.add_row(f"kill → survivors hold {res['survivors_hold']:,}", ms(res["survivors_full_s"]))
    t.add_row("most held by one survivor", num(res["most_per_survivor"]))
    t.add_row("triggers waiting (wake-up messages in the queue)",
              f"{num(res['waiting'])} ({num(res['queue_messages'])})")
    t.add_row("replacement started → all running", ms(res["all_running_after_replacement_s"]))
    t.caption = ("Survivors' counts are trigger rows they own (polled every 0.1 s). Beyond "
                 "their capacity the wake-ups stay ready in the queue; a consumer with room "
                 "(the replacement) takes them. Shipped defaults but capacity.")
    return t
