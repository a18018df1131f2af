"""The topology on a 3-node RabbitMQ cluster: a node stops mid-burst, every task is applied once.

Three nodes of the suite's own (tests/services.py's launcher, each on its own ports) are
clustered with ``join_cluster``; the team queue and the events queue are quorum queues, so
their messages live on all three and a majority keeps them available. The consumer and the
writer connect to the first node; a second node (a member of both queues) is stopped while
the timers fire.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.conftest import FAST, Processes, wait_until
from tests.services import BASE, RabbitNode
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers import DateTimeTrigger

BURST = 3_000
SPREAD = 3.0  # seconds the instants are spread over, so the stop lands inside the burst


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RabbitNode]]:
    BASE.mkdir(parents=True, exist_ok=True)
    # "<pid>-..." like the session's own services: a killed run is reaped by the next one
    root = BASE / f"{os.getpid()}-cluster{uuid.uuid4().hex[:6]}"
    root.mkdir(mode=0o755)
    nodes = [RabbitNode(root / f"rabbit{i}") for i in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(RabbitNode.start, nodes))
        for node in nodes[1:]:
            node.stop_app()
            node.ctl("join_cluster", nodes[0].nodename)
            node.start_app()
        yield nodes
    finally:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(RabbitNode.stop, nodes))
        shutil.rmtree(root, ignore_errors=True)


def _running_nodes(node: RabbitNode) -> list[str]:
    status = json.loads(node.ctl("cluster_status", "--formatter", "json"))
    return sorted(status["running_nodes"])


async def test_a_node_stopping_mid_burst_loses_no_event(
    cluster: list[RabbitNode], dsn: str, tmp_path: Path,
) -> None:
    first, victim, _ = cluster
    assert _running_nodes(first) == sorted(n.nodename for n in cluster)
    namespace = f"tfc{uuid.uuid4().hex[:8]}"
    team = f"{namespace}.team"
    settings = Settings(
        database_url=dsn, amqp_url=first.url, namespace=namespace, queues=[team],
        allowed_modules=["triggerflow.triggers"], **FAST,  # type: ignore[arg-type]
    )
    broker = RabbitTransport(settings.amqp_dsn(), Topology(namespace), name="cluster-test")
    await broker.connect()
    await broker.declare([team])
    await broker.close()
    members = first.ctl("list_queues", "name", "type", "members", "--formatter", "json")
    queues = {q["name"]: q for q in json.loads(members)}
    for name in (team, Topology(namespace).events_queue):
        assert queues[name]["type"] == "quorum"
        assert victim.nodename in queues[name]["members"]  # its copy goes down with it

    procs = Processes(settings, tmp_path)
    db = await Database.connect(dsn, max_size=2)
    try:
        procs.writer()
        procs.consume(team)
        await wait_until(lambda: db.fetchval("SELECT count(*) = 2 FROM consumer"), 60,
                         message="consumer and writer registered")
        start = datetime.now(UTC) + timedelta(seconds=4)
        async with TriggerflowClient(settings) as client:
            await client.defer_many([
                Deferral(TaskKey("cluster", f"t{i}", "burst"),
                         DateTimeTrigger(start + timedelta(seconds=SPREAD * i / BURST)), team)
                for i in range(BURST)])
        await asyncio.sleep(max(0.0, (start - datetime.now(UTC)).total_seconds() + SPREAD / 3))
        fired_before_stop = await db.fetchval(
            "SELECT count(*) FROM task_instance WHERE state = 'scheduled'")
        await asyncio.to_thread(victim.stop)  # mid-burst
        await wait_until(
            lambda: db.fetchval("SELECT count(*) = $1 FROM task_instance "
                                "WHERE state = 'scheduled'", BURST),
            90, interval=0.5, message="every task applied")
        assert 0 < fired_before_stop < BURST, "the node must stop inside the burst"
        # Once each: its own instant as the event, no trigger row left, nothing dead-lettered.
        wrong = await db.fetchval(
            "SELECT count(*) FROM task_instance t JOIN LATERAL (SELECT $1::timestamptz + "
            "make_interval(secs => $2::float8 * substr(t.task_id, 2)::int / $3::float8) AS at) m ON true "
            "WHERE (abs(extract(epoch FROM (t.next_kwargs->>'event')::timestamptz - m.at)) "
            "< 0.001) IS NOT TRUE",  # microseconds of float rounding apart, or missing
            start, SPREAD, BURST)
        assert wrong == 0
        assert await db.fetchval("SELECT count(*) FROM trigger") == 0
        broker = RabbitTransport(settings.amqp_dsn(), Topology(namespace), name="cluster-test")
        await broker.connect()
        dead = await broker.queue_info(Topology(namespace).dead_queue)
        await broker.close()
        assert dead is not None and dead.ready == 0
        assert all(p.poll() is None for p in procs.procs), "a process died with the node"
    finally:
        procs.stop_all()
        await db.close()
