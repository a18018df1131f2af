"""A 3-node RabbitMQ cluster of its own, and the node-loss scenario run by
``tests/test_cluster.py`` (which checks what it found) and ``triggerflow bench nodeloss``
(which prints how long applying stopped).

The scenario: the writer and one consumer reach the cluster through a forwarder that prefers
the victim node (a load balancer in front of the cluster: every new connection goes to the
first node that accepts, the victim while it is up); a second consumer of the same queue
connects straight to the third node, the SDK to the first. A burst of timers fires; the
victim stops in the middle of it, closing the writer's and the first consumer's connections;
they reconnect through the forwarder, which sends them to the first node. Every apply is
logged by the row trigger of ``testbed/replication.py`` (``apply_log``), so a task applied
twice shows, and so does the longest pause between two applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from testbed.netproxy import tcp_proxy
from testbed.replication import (
    APPLY_LOG,
    ROOT,
    defer_spread,
    poll,
    wait_all_applied,
    wait_registered,
)
from testbed.services import BASE, RabbitNode, free_port
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.supervise import Supervisor, child_env
from triggerflow.transport.rabbitmq import RabbitTransport, Topology


@contextlib.contextmanager
def rabbit_cluster(size: int = 3) -> Iterator[list[RabbitNode]]:
    """``size`` nodes of testbed/services.py's launcher, joined with ``join_cluster``."""
    BASE.mkdir(parents=True, exist_ok=True)
    # "<pid>-..." like the session's own services: a killed run is reaped by the next one
    root = BASE / f"{os.getpid()}-cluster{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    # a node booted 150-200 s at load average 30-50 (the suite's 120 s is for one node)
    nodes = [RabbitNode(root / f"rabbit{i}", start_timeout=360) for i in range(size)]
    try:
        # one after the other: three Erlang VMs booting at once on a loaded 2-core machine
        # missed testbed/services.py's 120 s start timeout (load average 27)
        for node in nodes:
            node.start()
        for node in nodes[1:]:
            node.stop_app()
            node.ctl("join_cluster", nodes[0].nodename)
            node.start_app()
        yield nodes
    finally:
        with ThreadPoolExecutor(size) as pool:
            list(pool.map(RabbitNode.stop, nodes))
        shutil.rmtree(root, ignore_errors=True)


def running_nodes(node: RabbitNode) -> list[str]:
    status = json.loads(node.ctl("cluster_status", "--formatter", "json"))
    return sorted(status["running_nodes"])


def _address(node: RabbitNode) -> tuple[str, int]:
    return ("127.0.0.1", node.amqp_port)


@dataclass
class NodeLossRun:
    tasks: int
    members: dict[str, list[str]] = field(default_factory=dict)  # queue -> its nodes
    queue_types: dict[str, str] = field(default_factory=dict)
    applied_before_stop: int = 0
    through_victim_before: int = 0  # connections the forwarder sent to the victim
    through_first_after: int = 0  # ... and to the first node once the victim was gone
    applies: Counter[str] = field(default_factory=Counter)
    longest_pause: float = float("nan")  # the longest gap between two applies, seconds
    worst_late: float = float("nan")  # the largest apply - due of any task
    stop_seconds: float = 0.0  # how long `rabbitmqctl stop` took
    complete: bool = False
    dead_lettered: int = -1
    events_ready: int = -1  # events waiting in the events queue at the end
    left: list[tuple[Any, ...]] = field(default_factory=list)  # (owner, attempt, rows) not applied
    alive: bool = False
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def applied_twice(self) -> int:
        return sum(1 for n in self.applies.values() if n > 1)


async def _declare(nodes: list[RabbitNode], dsn: str, run: NodeLossRun) -> Settings:
    first = nodes[0]
    namespace = f"tfc{uuid.uuid4().hex[:8]}"
    team = f"{namespace}.team"
    settings = Settings(
        database_url=dsn,
        amqp_url=first.url,
        namespace=namespace,
        queues=[team],
        allowed_modules=["triggerflow.triggers"],
    )
    broker = RabbitTransport(settings.amqp_dsn(), Topology(namespace), name="cluster-test")
    await broker.connect()
    await broker.declare([team])
    await broker.close()
    listed = first.ctl("list_queues", "name", "type", "members", "--formatter", "json")
    for q in json.loads(listed):
        if q["name"] in (team, Topology(namespace).events_queue):
            run.members[q["name"]] = q["members"]
            run.queue_types[q["name"]] = q["type"]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(APPLY_LOG)
    finally:
        await conn.close()
    return settings


async def _read_queues(config: Settings, run: NodeLossRun) -> None:
    """Dead letters and events left, read on the first node (tried a few times: once, right
    after the stop, the first connection to it closed before its channel opened)."""
    topo = Topology(config.namespace)
    for attempt in range(5):
        broker = RabbitTransport(config.amqp_dsn(), topo, name="cluster-test")
        try:
            await broker.connect()
            dead = await broker.queue_info(topo.dead_queue)
            events = await broker.queue_info(topo.events_queue)
        except Exception:
            if attempt == 4:
                raise
            await asyncio.sleep(2)
            continue
        finally:
            with contextlib.suppress(Exception):
                await broker.close()
        run.dead_lettered = dead.ready if dead is not None else -1
        run.events_ready = events.ready if events is not None else -1
        return


async def node_loss_mid_burst(
    nodes: list[RabbitNode],
    dsn: str,
    logdir: Path,
    *,
    burst: int = 3_000,
    spread: float = 3.0,
    timeout: float = 120.0,
    settings: dict[str, Any] | None = None,
) -> NodeLossRun:
    """Run the scenario once on ``nodes`` (the victim is ``nodes[1]``; it is left stopped) and
    a migrated, empty database ``dsn``; ``settings``: the processes' overrides."""
    first, victim, third = nodes[0], nodes[1], nodes[2]
    run = NodeLossRun(tasks=burst)
    config = await _declare(nodes, dsn, run)
    team = config.queues[0]
    port = free_port()
    sup = Supervisor(logdir, cwd=ROOT)
    async with tcp_proxy(port, _address(victim), _address(first)) as proxy:
        balanced = f"amqp://guest:guest@127.0.0.1:{port}/"
        env = child_env(config, pythonpath=str(ROOT), **(settings or {}))
        writer = sup.start("writer", env={**env, "TRIGGERFLOW_AMQP_URL": balanced})
        near = sup.start("consume", "--queue", team, env={**env, "TRIGGERFLOW_AMQP_URL": balanced})
        far = sup.start("consume", "--queue", team, env={**env, "TRIGGERFLOW_AMQP_URL": third.url})
        try:
            await wait_registered(dsn, 3, timeout=90)
            async with TriggerflowClient(config) as client:
                await defer_spread(client, "cluster", team, burst, spread)
            run.applied_before_stop = await poll(dsn, "SELECT count(*) FROM apply_log") or 0
            run.through_victim_before = proxy.to(_address(victim))
            routed_before = len(proxy.routed)
            stopping = time.monotonic()
            await asyncio.to_thread(victim.stop)  # mid-burst
            run.stop_seconds = time.monotonic() - stopping
            run.complete = await wait_all_applied(dsn, burst, timeout)
            await asyncio.sleep(2)  # a late duplicate apply would land by now
            run.through_first_after = sum(
                1 for t, ok in proxy.routed[routed_before:] if ok and t == _address(first)
            )
            conn = await asyncpg.connect(dsn)
            try:
                for r in await conn.fetch("SELECT task_id, count(*) AS n FROM apply_log GROUP BY 1"):
                    run.applies[r["task_id"]] = r["n"]
                run.left = [
                    tuple(r)
                    for r in await conn.fetch(
                        "SELECT owner_id, attempt, count(*) FROM trigger GROUP BY 1, 2 ORDER BY 1, 2"
                    )
                ]
                row = await conn.fetchrow(
                    "SELECT max(gap) AS pause, max(late) AS late FROM (SELECT extract(epoch FROM "
                    "at - lag(at) OVER (ORDER BY at))::float8 AS gap, "
                    "extract(epoch FROM at - due)::float8 AS late FROM apply_log) g"
                )
            finally:
                await conn.close()
            assert row is not None
            run.longest_pause, run.worst_late = row["pause"], row["late"]
            await _read_queues(config, run)
            run.alive = all(p.poll() is None for p in (writer, near, far))
        finally:
            await asyncio.to_thread(sup.stop_all)
            run.logs = {"writer": sup.log(writer), "near": sup.log(near), "far": sup.log(far)}
    return run
