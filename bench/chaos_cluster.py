"""``triggerflow bench chaos --topology cluster``: the servers of the run's own behind a
failover, and the two faults only they allow.

PostgreSQL is a primary with a synchronous streaming standby (``testbed/replication.py``);
every process, the SDK and the bench reach it through the URL listing both servers with
``target_session_attrs=read-write``, as a user behind an HA manager would. RabbitMQ is a
3-node cluster (``testbed/clusterloss.py``: quorum queues) that everyone reaches through a
forwarder that sends each new connection to the first node that accepts (a load balancer).

``pg_promote``: the primary SIGKILLed, its standby promoted the fault's ``seconds`` later, then
the old primary rebuilt as a standby of the new one and replication made synchronous again,
so the next promotion loses nothing either. ``rabbit_node_stop``: one node stopped
(``rabbitmqctl stop``) for the fault's ``seconds``, then started again until the cluster
lists it running. One promotion (or ``pg_restart`` of the primary) at a time, one broker
node down at a time: a majority of the quorum queues' replicas stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.chaos_plan import NODES

if TYPE_CHECKING:
    from bench.chaos_plan import Fault
    from testbed.replication import Replicated
    from testbed.services import PostgresCluster, RabbitNode


@dataclass
class Cluster:
    pg: Replicated
    nodes: list[RabbitNode]
    amqp_url: str  # the forwarder in front of the nodes
    pg_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    node_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def cause(self, fault: Fault) -> dict[str, Any]:
        if fault.kind == "pg_promote":
            return await self.promote(fault.seconds)
        if fault.kind == "rabbit_node_stop":
            return await self.stop_node(NODES.index(fault.slot), fault.seconds)
        assert fault.kind == "pg_restart"
        from bench.chaos_faults import restart_postgres

        async with self.pg_lock:  # whichever server is the primary now
            return await restart_postgres(self.pg.primary)

    async def promote(self, delay: float) -> dict[str, Any]:
        from testbed.replication import synchronous_again

        async with self.pg_lock:
            old, new = self.pg.primary, self.pg.standby
            before, standby = await _server(old), await _server(new)
            await asyncio.to_thread(self.pg.fail_over, delay)
            promoted = time.time()
            after = await _server(new)
            await asyncio.to_thread(self.pg.rejoin)  # the old one, a standby of the new one
            await synchronous_again(self.pg)
            return {"old_primary_port": old.port, "promoted_port": new.port,
                    "timeline_before": before["timeline"], "timeline_after": after["timeline"],
                    "in_recovery_before": standby["in_recovery"],
                    "in_recovery_after": after["in_recovery"], "promoted_at": promoted,
                    "rejoined_as_standby": (await _server(old))["in_recovery"]}

    async def stop_node(self, index: int, down: float) -> dict[str, Any]:
        from testbed.clusterloss import running_nodes

        victim, other = self.nodes[index], self.nodes[(index + 1) % len(self.nodes)]
        async with self.node_lock:
            stopping = time.monotonic()
            await asyncio.to_thread(victim.stop)
            stop_s = time.monotonic() - stopping
            while_stopped = await asyncio.to_thread(running_nodes, other)
            await asyncio.sleep(down)
            await asyncio.to_thread(victim.start)  # it rejoins: its data names the cluster
            deadline = time.monotonic() + 120
            after = await asyncio.to_thread(running_nodes, other)
            while victim.nodename not in after and time.monotonic() < deadline:
                await asyncio.sleep(1)
                after = await asyncio.to_thread(running_nodes, other)
            return {"node": victim.nodename, "stop_s": round(stop_s, 2),
                    "running_while_stopped": while_stopped, "running_after": after}


async def _server(cluster: PostgresCluster) -> dict[str, Any]:
    """In recovery (a standby) or not, and its timeline: a primary's from its WAL file name
    (a promotion starts the next), a standby's from what it receives."""
    import asyncpg

    conn = await asyncpg.connect(f"{cluster.url}/postgres")
    try:
        row = await conn.fetchrow(
            "SELECT pg_is_in_recovery() AS in_recovery, CASE WHEN pg_is_in_recovery() THEN "
            "(SELECT received_tli FROM pg_stat_wal_receiver) ELSE ('x' || substr(pg_walfile_name("
            "pg_current_wal_lsn()), 1, 8))::bit(32)::int END AS timeline")
    finally:
        await conn.close()
    assert row is not None
    return dict(row)


@contextlib.asynccontextmanager
async def private_topology() -> AsyncIterator[Cluster]:
    """A primary and its standby, a 3-node RabbitMQ cluster and the forwarder in front of
    it; all gone afterwards. Booted in threads: minutes on a loaded machine, and a blocked
    loop would miss its own connections' heartbeats."""
    from testbed.clusterloss import rabbit_cluster
    from testbed.netproxy import tcp_proxy
    from testbed.replication import replicated_postgres
    from testbed.services import free_port

    databases, brokers = replicated_postgres(), rabbit_cluster(3)
    pg = await asyncio.to_thread(databases.__enter__)
    try:
        nodes = await asyncio.to_thread(brokers.__enter__)
        try:
            port = free_port()
            async with tcp_proxy(port, *(("127.0.0.1", n.amqp_port) for n in nodes)):
                yield Cluster(pg, nodes, f"amqp://guest:guest@127.0.0.1:{port}/")
        finally:
            await asyncio.to_thread(brokers.__exit__, None, None, None)
    finally:
        await asyncio.to_thread(databases.__exit__, None, None, None)
