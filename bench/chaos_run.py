"""What both modes' chaos runs share: the nemesis that causes each planned fault at its
moment, the PostgreSQL cluster of the run's own it restarts, reads of the bench's own that
ride out such a restart, and what the queues and the dead-letter queue hold at the end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.chaos_cluster import Cluster
    from bench.chaos_faults import EventTap, Fleet
    from bench.chaos_plan import Plan
    from bench.harness import Bench
    from testbed.services import PostgresCluster


def json_or_none(value: str | None) -> Any:
    return None if value is None else json.loads(value)


async def nemesis(plan: Plan, fleet: Fleet, tap: EventTap, cluster: PostgresCluster,
                  t0: float, record: list[dict[str, Any]],
                  servers: Cluster | None = None) -> None:
    """Each fault at its moment, as its own task: faults overlap (a stopped writer while a
    consumer is killed and PostgreSQL restarts). ``servers``: ``--topology cluster``'s."""
    from bench.chaos_faults import cause

    rng = random.Random(f"{plan.seed}/replay")
    running = []

    async def one(fault: Any) -> None:
        result = await cause(fault, fleet, tap, cluster, rng, t0, servers)
        record.append(result)
        fleet.b.log(f"fault {fault.kind} {fault.slot} at +{result['offset']:.1f}s: "
                    f"{result['witness']}")

    for fault in plan.faults:
        await asyncio.sleep(max(0.0, t0 + fault.at - time.time()))
        running.append(asyncio.ensure_future(one(fault)))
    await asyncio.gather(*running)


async def retry(b: Bench, query: Any, within: float = 60.0) -> Any:
    """A read of the bench's own that rides out a PostgreSQL restart."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await query(b.db())
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def messages(b: Bench, queues: dict[str, str]) -> dict[str, int]:
    assert b.broker is not None
    t = b.broker.topology
    out = {}
    for name in (*queues.values(), t.events_queue, t.dead_queue):
        info = await b.broker.queue_info(name)
        out[name] = info.ready if info else 0
    return out


async def dead_letters(b: Bench, most: int = 2000) -> list[dict[str, Any]]:
    """What the dead-letter queue holds: who put each there and why (the broker's
    ``x-death`` for a delivery limit, triggerflow's reason header for a refusal)."""
    from triggerflow.wire import HEADER_REASON

    assert b.broker is not None and b.broker.connection is not None
    ch = await b.broker.connection.channel()
    out: list[dict[str, Any]] = []
    try:
        queue = await ch.declare_queue(b.broker.topology.dead_queue, passive=True)
        while len(out) < most:
            message = await queue.get(no_ack=False, fail=False)
            if message is None:
                break
            deaths: Any = message.headers.get("x-death") or []
            out.append({"reason": str(message.headers.get(HEADER_REASON, "")),
                        "x-death": [{k: str(d.get(k)) for k in ("reason", "queue", "count")}
                                    for d in deaths],
                        "routing_key": message.routing_key, "body": message.body[:300].decode(
                            errors="replace")})
    finally:
        await ch.close()  # unacked: they stay for the count, deleted with the queue
    return out


@contextlib.asynccontextmanager
async def private_cluster(tag: str) -> AsyncIterator[tuple[Path, PostgresCluster]]:
    """A directory and a running PostgreSQL cluster of the run's own (the nemesis restarts
    it); both gone afterwards. Named by our pid: reaped by the next start if we die."""
    from testbed.services import BASE, FAST_PG, PostgresCluster

    BASE.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(PermissionError):
        BASE.chmod(0o1777)
    root = BASE / f"{os.getpid()}-{tag}{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    cluster = PostgresCluster(root / "postgres", settings=dict(FAST_PG))
    try:
        await asyncio.to_thread(cluster.start)
        yield root, cluster
    finally:
        await asyncio.to_thread(cluster.stop)
        shutil.rmtree(root, ignore_errors=True)
