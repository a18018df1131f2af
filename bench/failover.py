"""Scenario failover: SIGKILL and SIGTERM of a consumer, its peer takes over."""


from __future__ import annotations

import asyncio
import functools
import math
import signal
import statistics
from typing import TYPE_CHECKING, Any

from bench.common import BenchError, median_of, ms, num
from bench.harness import Bench, _run_id

if TYPE_CHECKING:
    from rich.table import Table

async def _failover_once(b: Bench, sig: signal.Signals) -> dict[str, Any]:
    n = b.sizes.failover
    await b.reset()
    victim = await b.start_consumer()
    peer = await b.start_consumer()
    vid, pid_ = await b.consumer_id(victim), await b.consumer_id(peer)
    await b.defer(2 * n, _run_id("failover"))
    ok, _ = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id IS NOT NULL", 2 * n, 120)
    if not ok:
        raise BenchError("the two consumers did not claim every trigger")
    await asyncio.sleep(b.sizes.settle)  # renewals report the counts; rebalancing settles
    held = await b.owned(vid)
    busy = await b.quiet()
    t0 = float(await b.db().fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))
    victim.popen.send_signal(sig)
    done, t_all = await b.wait_for("SELECT count(*) FROM trigger WHERE owner_id = $1", 2 * n,
                                   b.sizes.failover_timeout, pid_)
    detail = await b.db().fetchrow(
        "SELECT extract(epoch FROM min(dispatched_at))::float8 AS freed, "
        "extract(epoch FROM max(claimed_at))::float8 AS last_claim, "
        "count(*) FILTER (WHERE quarantined_at IS NOT NULL) AS quarantined, "
        "count(*) FILTER (WHERE failures > 0) AS suspects "
        "FROM trigger WHERE claimed_at > to_timestamp($1) OR dispatched_at > to_timestamp($1)",
        t0)
    assert detail is not None
    moved = await b.owned(pid_)
    await b.stop(victim, signal.SIGKILL)
    await b.stop(peer)
    freed = (detail["freed"] - t0) if detail["freed"] else math.nan
    return {"signal": sig.name, "held": held, "machine_busy_before": busy, "moved": moved,
            "complete": done, "seconds": t_all - t0, "freed_after_s": freed,
            "quarantined": detail["quarantined"], "suspects_left": detail["suspects"]}


async def scenario_failover(b: Bench) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for sig in (signal.SIGKILL, signal.SIGTERM):
        runs = []
        for i in range(b.sizes.failover_repeats):
            r = await b.measured(f"failover {sig.name}", functools.partial(_failover_once, b, sig))
            runs.append(r)
            b.log(f"failover: {sig.name} run {i + 1}: {r['held']:,} triggers on the peer after "
                  f"{r['seconds']:.2f}s (freed after {r['freed_after_s']:.2f}s)"
                  + ("" if r["complete"] else " [red]INCOMPLETE"))
        out[sig.name] = {"runs": runs, "seconds": median_of(runs, "seconds"),
                         "max_seconds": max(r["seconds"] for r in runs),
                         "freed_after_s": median_of(runs, "freed_after_s")}
        b.log(f"failover: {sig.name} over {len(runs)} runs: median "
              f"{out[sig.name]['seconds']:.2f}s, max {out[sig.name]['max_seconds']:.2f}s")
    return out


def table_failover(res: dict[str, Any], n: int) -> Table:
    from rich.table import Table

    t = Table(title=f"Failover: a consumer holding ~{n:,} timers stops, its peer (also "
              f"holding ~{n:,}) takes them over")
    for col in ("signal", "held by victim", "freed (median)", "all on peer (median)",
                "all on peer (max)", "runs", "complete"):
        t.add_column(col, justify="right")
    for name in ("SIGKILL", "SIGTERM"):
        r = res[name]
        t.add_row(name, num(statistics.median(x["held"] for x in r["runs"])),
                  ms(r["freed_after_s"]), ms(r["seconds"]),
                  ms(max(x["seconds"] for x in r["runs"])),
                  ", ".join(ms(x["seconds"]) for x in r["runs"]),
                  "yes" if all(x["complete"] for x in r["runs"]) else "[red]NO")
    t.caption = ("From the signal (DB clock) until every trigger is owned by the peer (polled "
                 "every 50 ms). Freed = the reaper/release put the first one back "
                 "(trigger.dispatched_at). Default lease_ttl 3 s, renew_interval 1 s; a killed "
                 "consumer is taken over when the broker deletes its presence queue.")
    return t


# ----------------------------------------------------------------------------- summary
