"""Scenario nodeloss: a 3-node RabbitMQ cluster of the scenario's own; the node the writer
and one consumer reach stops mid-burst (``testbed/clusterloss.py``, which
``tests/test_cluster.py`` runs and checks). Printed: the longest pause between two applies,
how late the latest task was, and whether every task was applied once.

Each run uses a fresh database beside the bench's (``<bench database>_nodeloss``) and a fresh
namespace; the stopped node is started again (it rejoins the cluster) before the next run.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg

from bench.common import ms, num

if TYPE_CHECKING:
    from rich.table import Table

    from bench.harness import Bench


async def _fresh_database(admin_dsn: str) -> str:
    from triggerflow.store.postgres import database_name, upgrade_schema, with_database

    name = f"{database_name(admin_dsn)}_nodeloss"
    conn = await asyncpg.connect(with_database(admin_dsn, "postgres"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    dsn = with_database(admin_dsn, name)
    await asyncio.to_thread(upgrade_schema, dsn)
    return dsn


async def _once(b: Bench, nodes: list[Any]) -> dict[str, Any]:
    from testbed.clusterloss import node_loss_mid_burst

    dsn = await _fresh_database(b.admin_dsn)
    logdir = Path(tempfile.mkdtemp(prefix="nodeloss-", dir=b.out))
    run = await node_loss_mid_burst(nodes, dsn, logdir, burst=b.sizes.nodeloss,
                                    spread=b.sizes.promote_spread,
                                    timeout=b.sizes.failover_timeout)
    await asyncio.to_thread(nodes[1].start)  # back into the cluster for the next run
    return {"tasks": run.tasks, "applied": len(run.applies), "applied_twice": run.applied_twice,
            "longest_pause_s": run.longest_pause, "worst_late_s": run.worst_late,
            "stop_s": run.stop_seconds, "applied_before_stop": run.applied_before_stop,
            "dead_lettered": run.dead_lettered, "complete": run.complete, "alive": run.alive,
            "via_victim": run.through_victim_before, "via_first_after": run.through_first_after}


async def scenario_nodeloss(b: Bench) -> dict[str, Any]:
    from testbed.clusterloss import rabbit_cluster

    cluster = rabbit_cluster(3)
    # in a thread: three Erlang VMs take minutes to boot under load, and a blocked loop
    # misses the bench's own broker heartbeats
    nodes = await asyncio.to_thread(cluster.__enter__)
    runs = []
    try:
        for i in range(b.sizes.nodeloss_repeats):
            r = await _once(b, nodes)
            runs.append(r)
            b.log(f"nodeloss run {i + 1}: longest pause {r['longest_pause_s']:.2f}s, latest "
                  f"task {r['worst_late_s']:.2f}s late; {r['applied']:,}/{r['tasks']:,} applied,"
                  f" {r['applied_twice']} twice")
    finally:
        await asyncio.to_thread(cluster.__exit__, None, None, None)
    return {"runs": runs, "all_once": all(
        r["complete"] and r["applied_twice"] == 0 and r["dead_lettered"] == 0 for r in runs)}


def table_nodeloss(res: dict[str, Any]) -> Table:
    from rich.table import Table

    runs = res["runs"]
    t = Table(title=f"Broker node lost mid-burst ({num(runs[0]['tasks'])} timers): the node "
              "the writer and one consumer are connected to stops")
    for col in ("", "median", "max"):
        t.add_column(col, justify="right")
    for key, label in (("longest_pause_s", "longest pause between two applies"),
                       ("worst_late_s", "latest task: applied - due"),
                       ("stop_s", "rabbitmqctl stop took")):
        values = [r[key] for r in runs]
        t.add_row(label, ms(statistics.median(values)), ms(max(values)))
    t.add_row("tasks applied / applied twice / dead-lettered",
              f"{num(min(r['applied'] for r in runs))} / "
              f"{max(r['applied_twice'] for r in runs)} / "
              f"{max(r['dead_lettered'] for r in runs)}", "")
    t.caption = (f"{len(runs)} runs, 3-node cluster, quorum queues, shipped defaults. The "
                 "writer and a consumer connect through a forwarder that prefers the stopped "
                 "node (a load balancer); a second consumer is on another node. "
                 + ("Every task applied exactly once in every run." if res["all_once"]
                    else "[red]Some run lost, doubled or dead-lettered a task."))
    return t
