"""The topology on a 3-node RabbitMQ cluster: the node the writer and one consumer are
connected to stops mid-burst; every task is applied once and nothing is dead-lettered.

Three nodes of the suite's own (testbed/services.py's launcher, each on its own ports) are
clustered with ``join_cluster``; the team queue and the events queue are quorum queues, so
their messages live on all three and a majority keeps them available. The writer and one
consumer reach the cluster through a forwarder that prefers the victim (a load balancer in
front of the cluster); the other consumer is on the third node. The scenario is
testbed/clusterloss.py's, which ``triggerflow bench nodeloss`` times.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed.clusterloss import node_loss_mid_burst, rabbit_cluster, running_nodes
from testbed.services import RabbitNode
from tests.conftest import FAST


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RabbitNode]]:
    with rabbit_cluster(3) as nodes:
        yield nodes


# three nodes booted one after the other and joined (about a minute idle; over five at load
# average 30, beyond the suite's 300 s), then the burst
@pytest.mark.timeout(900)
async def test_the_node_of_the_writer_and_a_consumer_stopping_mid_burst_loses_no_event(
    cluster: list[RabbitNode],
    dsn: str,
    tmp_path: Path,
) -> None:
    first, victim, _ = cluster
    assert running_nodes(first) == sorted(n.nodename for n in cluster)
    run = await node_loss_mid_burst(cluster, dsn, tmp_path, burst=3_000, settings=FAST)
    where = "\n".join(f"--- {name}:\n{log[-1500:]}" for name, log in run.logs.items())
    for name, members in run.members.items():  # the team queue and the events queue
        assert run.queue_types[name] == "quorum"
        assert victim.nodename in members  # its copy goes down with it
    assert len(run.members) == 2
    # The writer and the near consumer were on the victim (each opens its connections
    # through the forwarder), and came back through it to the first node.
    assert run.through_victim_before >= 2, run.through_victim_before
    assert run.through_first_after >= 2, (run.through_first_after, where)
    assert 0 < run.applied_before_stop < 3_000, "the node must stop inside the burst"
    assert run.complete, (len(run.applies), run.left, run.events_ready, where)
    assert len(run.applies) == 3_000 and run.applied_twice == 0, run.applies.most_common(3)
    assert run.dead_lettered == 0
    assert run.alive, "a process died with the node\n" + where
    assert "broker connection lost; reconnecting" in run.logs["writer"], where
    # The near consumer reacts to the node's loss one of two ways, whichever it sees first:
    # its session's check finds the connection closed, or its renewal finds that a peer
    # already ended its lease on the broker's word (presence) and it re-registers afresh.
    assert ("broker connection lost; reconnecting" in run.logs["near"]
            or "lease lost (lease had expired in the database)" in run.logs["near"]), where
