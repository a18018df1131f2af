"""Scenario defer and the SDK worker process it starts (`python -m bench sdk-worker`)."""


from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from bench.common import FAR, BenchError, dist, ms, num
from bench.harness import Bench, _run_id

if TYPE_CHECKING:
    from rich.table import Table


async def _sdk_workers(b: Bench, procs: int, mode: str, *, count: int = 0,
                       seconds: float = 0.0, batch: int = 1) -> list[dict[str, Any]]:
    await b.quiet()
    # after every worker has imported and connected
    start_at = time.time() + b.sizes.lead + b.sizes.worker_stagger * procs
    run = _run_id(f"defer-{mode}")
    env = b.env("sdk")
    workers = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench", "sdk-worker", "--mode", mode,
        "--count", str(count), "--seconds", str(seconds), "--batch", str(batch),
        "--start-at", str(start_at), "--queue", b.queue, "--run-id", f"{run}-{i}",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        for i in range(procs)]
    results = []
    for w in workers:
        stdout, stderr = await w.communicate()
        if w.returncode != 0:
            raise BenchError(f"sdk worker failed: {stderr.decode()[-2000:]}")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return results


def _combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    lat = [x for r in results for x in r["latencies"]]
    n = sum(r["n"] for r in results)
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"procs": len(results), "n": n, "seconds": elapsed, "per_s": n / elapsed,
            **{f"lat_{k}": v for k, v in dist(lat).items() if k != "n"}}


async def scenario_defer(b: Bench) -> dict[str, Any]:
    s = b.sizes
    await b.reset()
    out: dict[str, Any] = {}
    b.log(f"defer: 1 process, {s.defer_single:,} single defer() calls")
    out["single"] = _combine(await _sdk_workers(b, 1, "single", count=s.defer_single))
    b.log(f"defer: 1 process, {s.defer_batched:,} in batches of {s.defer_batch:,}")
    out["batched"] = _combine(await _sdk_workers(b, 1, "batched", count=s.defer_batched,
                                                 batch=s.defer_batch))
    b.log(f"defer: {s.defer_procs} processes, single defer() for {s.defer_seconds:.0f}s")
    out["single_many"] = _combine(await _sdk_workers(b, s.defer_procs, "single",
                                                     seconds=s.defer_seconds))
    b.log(f"defer: {s.defer_procs} processes, batches of {s.defer_batch:,}")
    out["batched_many"] = _combine(await _sdk_workers(
        b, s.defer_procs, "batched", count=s.defer_batched // 2, batch=s.defer_batch))
    await b.purge()
    return out


def table_defer(res: dict[str, Any], batch: int) -> Table:
    from rich.table import Table

    t = Table(title="Deferral through the SDK (TriggerflowClient; no consumer running)")
    for col in ("case", "processes", "deferrals", "seconds", "deferrals/s", "call p50",
                "call p99"):
        t.add_column(col, justify="right")
    for key, label in (("single", "defer(), one at a time"),
                       ("batched", f"defer_many(), {batch:,} a call"),
                       ("single_many", "defer(), one at a time"),
                       ("batched_many", f"defer_many(), {batch:,} a call")):
        r = res[key]
        t.add_row(label, str(r["procs"]), num(r["n"]), f"{r['seconds']:.2f}", num(r["per_s"]),
                  ms(r["lat_p50"]), ms(r["lat_p99"]))
    t.caption = ("Each call: one DEFER statement (trigger rows + task instances 'deferred'), "
                 "then a confirmed, mandatory publish of the wake-up; measured in separate SDK "
                 "processes started together (plain asyncio loop).")
    return t


# ----------------------------------------------------------------------------- SDK worker


async def _sdk_worker(args: Any) -> dict[str, Any]:
    from triggerflow.model import TaskKey
    from triggerflow.sdk import Deferral, TriggerflowClient
    from triggerflow.settings import Settings
    from triggerflow.triggers import DateTimeTrigger

    moment = datetime.now(UTC) + timedelta(seconds=FAR)
    async with TriggerflowClient(Settings(**{})) as client:  # from TRIGGERFLOW_* only
        for i in range(20):  # warm: connections, prepared statements, routability
            await client.defer(TaskKey("bench", f"warm{i}", args.run_id), DateTimeTrigger(moment),
                               queue=args.queue)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        lat: list[float] = []
        n = 0
        start = time.time()
        if args.mode == "single":
            end_at = start + args.seconds if args.seconds else math.inf
            while (args.count and n < args.count) or (not args.count and time.time() < end_at):
                t = time.perf_counter()
                await client.defer(TaskKey("bench", f"s{n}", args.run_id), DateTimeTrigger(moment),
                                   queue=args.queue)
                lat.append(time.perf_counter() - t)
                n += 1
        else:
            while n < args.count:
                size = min(args.batch, args.count - n)
                t = time.perf_counter()
                await client.defer_many([
                    Deferral(TaskKey("bench", f"b{n + i}", args.run_id), DateTimeTrigger(moment),
                             args.queue) for i in range(size)])
                lat.append(time.perf_counter() - t)
                n += size
        end = time.time()
    return {"n": n, "start": start, "end": end, "latencies": lat}


def _worker_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="bench sdk-worker")
    p.add_argument("--mode", choices=["single", "batched"], required=True)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--start-at", type=float, required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--run-id", required=True)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(_sdk_worker(args))))
    return 0
