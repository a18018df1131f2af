"""Rebalancing's view of the peers: a renewal that reads them counts the live consumers
subscribed on the broker with exactly my queue set, and what they run. Consumers of another
queue set cannot take my triggers (counted, they would shed to each other forever), a dead
row runs nothing, and a writer's row is no consumer. Every store, the same cases."""

from __future__ import annotations

from tests.contract.backends import Backend, register
from triggerflow.store import ProcessKind

A, B = "team-a", "team-b"
LONG = 600.0  # outlives the case: only the row made to expire does


async def peers(backend: Backend, me: int, running: int, queues: list[str]) -> tuple[int, int]:
    """(live_peers, peers_running) as my renewal reads them: a SQL store reads the peers on
    its first renewal, then every few seconds, so each reading is a fresh process's first."""
    async with backend.process() as own:
        renewal = await own.renew(me, LONG, running, queues, subscribed=True)
    assert renewal is not None
    return renewal.live_peers, renewal.peers_running


async def test_a_renewal_counts_the_live_consumers_of_exactly_its_queue_set(
    backend: Backend,
) -> None:
    store = backend.store
    me = await register(backend, [A], LONG)
    peer = await register(backend, [A], LONG)
    assert await store.renew(peer, LONG, 7, [A], subscribed=True) is not None
    wider = await register(backend, [A, B], LONG)  # serves A too, but not my queue set
    assert await store.renew(wider, LONG, 11, [A, B], subscribed=True) is not None
    # A writer's row is no consumer whatever queues it names (writers name none).
    writer = await register(backend, [A], LONG, kind=ProcessKind.WRITER)
    assert await store.renew(writer, LONG, 13, [A], subscribed=True) is not None
    dying = await register(backend, [A], 20)
    assert await store.renew(dying, 20, 5, [A], subscribed=True) is not None
    assert await peers(backend, me, 3, [A]) == (3, 3 + 7 + 5)
    await backend.travel(30)  # its lease expires: it runs nothing any more

    assert await peers(backend, me, 3, [A]) == (2, 3 + 7)
    # The wider consumer's only peer is itself: those of A alone cannot take its B triggers.
    assert await peers(backend, wider, 11, [A, B]) == (1, 11)
