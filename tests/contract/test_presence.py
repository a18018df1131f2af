"""Presence: the broker said a consumer's connection closed. Its lease ends at once, for
that incarnation only and only at the hands of a peer of its queues, and the loss is judged
as an expiry would be. A writer's ends the same way, for that writer only. Every store, the
same cases."""

from __future__ import annotations

from tests.contract.backends import Backend, register
from tests.contract.test_failover import TTL, freed
from triggerflow.store import ProcessKind

A, B = "team-a", "team-b"


async def test_a_closed_connection_ends_that_incarnations_lease_as_an_expiry_would(
    backend: Backend,
) -> None:
    store = backend.store
    trigger = await backend.defer(A)
    peer = await register(backend, [A], TTL)
    victim = await register(backend, [A], TTL)
    assert [s.id for s in (await store.claim(victim, [trigger], [A])).claimed] == [trigger]
    assert await store.announce_presence(victim, "amq.gen-first")
    assert await store.announce_presence(victim, "amq.gen-second")  # it reconnected
    await backend.travel(1)
    assert await store.renew(peer, TTL, 0, [A]) is not None

    assert await store.presence_gone("amq.gen-first", [A]) == []  # an older connection's
    assert await store.presence_gone("amq.gen-second", [B]) == []  # not a peer's word
    assert await store.renew(victim, TTL, 1, [A]) is not None  # neither ended anything
    assert await store.presence_gone("amq.gen-second", [A]) == [victim]
    assert await store.presence_gone("amq.gen-second", [A]) == []  # ended once

    await backend.travel(0.1)
    assert await store.renew(victim, TTL, 1, [A]) is None  # it finds itself fenced
    reaped = await store.reap_dead([A], max_failures=5)
    assert reaped.dead_owners == 1
    # the peer stayed valid across the victim's end with a lease no longer: witnessed, blamed
    assert freed(reaped) == [(trigger, 1, False)]


async def test_a_gone_row_names_nothing(backend: Backend) -> None:
    me = await register(backend, [A], TTL)
    await backend.store.unregister(me)
    assert not await backend.store.announce_presence(me, "amq.gen-late")
    assert await backend.store.presence_gone("amq.gen-late", [A]) == []


async def test_a_writers_closed_connection_ends_only_that_writers_lease(backend: Backend) -> None:
    store = backend.store
    writer = await register(backend, [], TTL, kind=ProcessKind.WRITER)
    consumer = await register(backend, [A], TTL)
    assert await store.announce_presence(writer, "amq.gen-writer-old")
    assert await store.announce_presence(writer, "amq.gen-writer")  # it reconnected
    assert await store.announce_presence(consumer, "amq.gen-consumer")

    assert await store.writer_gone("amq.gen-writer-old") == []  # an older connection's
    assert await store.writer_gone("amq.gen-consumer") == []  # a consumer's is not a writer's
    assert await store.presence_gone("amq.gen-writer", [A]) == []  # nor the reverse
    assert await store.renew(consumer, TTL, 0, [A]) is not None
    assert await store.writer_gone("amq.gen-writer") == [writer]
    assert await store.writer_gone("amq.gen-writer") == []  # ended once

    await backend.travel(0.1)
    assert await store.renew(writer, TTL, 0, []) is None  # its row reads dead
    assert await store.renew(consumer, TTL, 0, [A]) is not None


async def test_a_renewal_says_whether_a_peer_of_its_queues_is_dead(backend: Backend) -> None:
    """What starts a reaper sweep at once: an expired row sharing one of my queues, not mine
    (alive) nor one of another queue's (its own consumers reap it)."""
    store = backend.store

    async def dead_peers(me: int, queues: list[str]) -> bool:
        renewal = await store.renew(me, 600, 0, queues, subscribed=True)
        assert renewal is not None
        return bool(renewal.dead_peers)

    me = await register(backend, [A], ttl=600)
    theirs = await register(backend, [B], ttl=600)
    writer = await register(backend, [], ttl=600, kind=ProcessKind.WRITER)
    await register(backend, [B], ttl=20)
    assert not await dead_peers(me, [A])  # only live rows: mine
    assert not await dead_peers(writer, [])
    await backend.travel(30)  # B's second consumer expires
    assert not await dead_peers(me, [A])
    assert await dead_peers(theirs, [B])
    assert await dead_peers(writer, [])  # a renewal of no queues (a writer's): any dead row
    both = await register(backend, [A, B], ttl=600)
    assert await dead_peers(both, [A, B])


async def test_a_consumer_whose_lease_a_peer_ended_claims_nothing(backend: Backend) -> None:
    """A consumer that lost only its broker connection does not know yet that a peer ended
    its lease; a claim it makes meanwhile takes nothing, before and after a reaper deleted
    its row (an owner no reaper frees would keep the trigger forever). The trigger stays
    for the peer and for the backstop."""
    store = backend.store
    trigger = await backend.defer(A)
    peer = await register(backend, [A], TTL)
    victim = await register(backend, [A], TTL)
    assert await store.announce_presence(victim, "amq.gen-victim")
    assert await store.presence_gone("amq.gen-victim", [A]) == [victim]
    await backend.travel(0.1)
    assert (await store.claim(victim, [trigger], [A])).claimed == []
    assert await store.renew(peer, TTL, 0, [A]) is not None
    await store.reap_dead([A], max_failures=5)  # deletes the victim's row (it held nothing)
    assert (await store.claim(victim, [trigger], [A])).claimed == []
    assert await store.claim_probation(victim, [A]) == []
    [spec] = (await store.claim(peer, [trigger], [A])).claimed
    assert spec.id == trigger
