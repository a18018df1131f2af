"""Fencing by attempt and by queue, claims against live and expired owners, and releases
at exact attempts only: every store, the same cases."""

from __future__ import annotations

from tests.contract.backends import NEXT_KWARGS, Backend, register
from tests.contract.conftest import only
from tests.contract.events import PAYLOAD, event
from triggerflow.store import TriggerRef

A, B = "team-a", "team-b"


async def test_an_event_applies_only_at_the_current_attempt(backend: Backend) -> None:
    store = backend.store
    t = await backend.defer(A)
    first = await register(backend, [A], ttl=20)
    found = await store.claim(first, [t], [A])
    assert ([(s.id, s.attempt) for s in found.claimed], found.suspects, found.refused) == (
        [(t, 1)], [], [])
    await backend.travel(30)  # first's lease expires
    second = await register(backend, [A], ttl=300)
    [spec] = (await store.claim(second, [t], [A])).claimed
    assert spec.attempt == 2  # the second claim raised the attempt: first is fenced
    bystander = await backend.defer(A)  # another trigger, now at attempt 1
    assert [s.attempt for s in (await store.claim(second, [bystander], [A])).claimed] == [1]

    assert await store.apply_events([event(t, 1, A)]) == []  # the fenced owner's event
    assert await store.apply_events([event(t, 3, A)]) == []  # an attempt nobody holds
    assert (await backend.task(t)).state == "deferred"

    applied = await store.apply_events([event(t, 2, A)])
    assert [(a.kind, a.queue) for a in applied] == [("resume", A)]
    after = await backend.task(t)
    assert after.state == "scheduled"
    assert after.next_kwargs == {**NEXT_KWARGS, "event": PAYLOAD}
    # Applied again (a redelivery): no change.
    assert await store.apply_events([event(t, 2, A, payload={"other": 1})]) == []
    assert await backend.task(t) == after


async def test_an_event_naming_another_queue_than_its_trigger_changes_nothing(
    backend: Backend,
) -> None:
    store = backend.store
    t = await backend.defer(A)
    u = await backend.defer(B)
    me = await register(backend, [A, B], ttl=300)
    claimed = (await store.claim(me, [t, u], [A, B])).claimed
    assert sorted((s.id, s.attempt) for s in claimed) == [(t, 1), (u, 1)]

    # Team B names A's trigger at its current attempt, under its own queue.
    assert await store.apply_events([event(t, 1, B)]) == []
    assert (await backend.task(t)).state == "deferred"
    assert [a.queue for a in await store.apply_events([event(t, 1, A)])] == [A]
    assert (await backend.task(t)).state == "scheduled"
    assert (await backend.task(u)).state == "deferred"


async def test_a_live_owner_keeps_its_trigger_and_an_expired_one_loses_it(
    backend: Backend,
) -> None:
    store = backend.store
    t = await backend.defer(A)
    owner = await register(backend, [A], ttl=20)
    peer = await register(backend, [A], ttl=600)
    assert [s.attempt for s in (await store.claim(owner, [t], [A])).claimed] == [1]

    refused = await store.claim(peer, [t], [A])
    assert (refused.claimed, refused.suspects, refused.refused) == ([], [], [])
    assert (await store.claim(owner, [t], [A])).claimed == []  # not even again by its owner
    assert (await store.claim(peer, [t], [B])).claimed == []  # nor for another queue

    await backend.travel(30)  # the owner's lease is over; the peer's is not
    assert await store.renew(owner, 20, 1, [A]) is None  # fenced
    [spec] = (await store.claim(peer, [t], [A])).claimed
    assert (spec.id, spec.attempt, spec.queue) == (t, 2, A)


async def test_release_and_release_lost_act_on_exact_owners_and_attempts_only(
    backend: Backend,
) -> None:
    store = backend.store
    await backend.defer(B)  # another queue's trigger: never in what is handed back
    t = await backend.defer(A)
    me = await register(backend, [A], ttl=300)
    other = await register(backend, [A], ttl=300)
    await store.claim(me, [t], [A])

    assert await store.release_lost(me, [t], [2]) == []  # not the attempt I run
    assert await store.release_lost(other, [t], [1]) == []  # not mine
    assert await store.release(other, [t]) == []
    assert (await store.claim(other, [t], [A])).claimed == []  # still held by me

    kept = await backend.defer(A)
    await store.claim(me, [kept], [A])
    assert await store.release_lost(me, [t], [1]) == [TriggerRef(t, A)]  # that row only
    assert await store.release_lost(me, [t], [1]) == []  # idempotent
    assert (await store.claim(other, [kept], [A])).claimed == []
    [spec] = (await store.claim(other, [t], [A])).claimed
    assert spec.attempt == 2

    assert await store.release(me, [t]) == []  # not mine now
    assert await store.release(other, [t]) == [TriggerRef(t, A)]
    assert await store.release(other, [t]) == []  # idempotent
    [spec] = (await store.claim(me, [t], [A])).claimed
    assert spec.attempt == 3
    assert sorted(r.id for r in await store.release(me)) == sorted([t, kept])  # all of mine


async def test_a_trigger_i_cannot_load_is_passed_on_then_failed_when_nobody_can(
    backend: Backend,
) -> None:
    store = backend.store
    t = await backend.defer(A)
    me = await register(backend, [A], ttl=300)
    peer = await register(backend, [A], ttl=20)  # a peer that may still load it
    await store.claim(me, [t], [A])
    assert await store.other_loaders(t, me) == 1
    assert await store.release(me, [t], cannot_load=True, reason="no module x") == [
        TriggerRef(t, A)]
    again = await store.claim(me, [t], [A])
    assert (again.claimed, again.refused) == ([], [TriggerRef(t, A)])
    assert await store.fail_unloadable(me, [t]) == []  # the peer may still load it
    await store.claim(peer, [t], [A])

    await backend.travel(30)  # the peer dies holding it: nobody left who has not refused it
    assert await store.other_loaders(t, me) == 0
    held = await store.claim(me, [t], [A])  # still the dead peer's: not passed on yet
    assert (held.claimed, held.refused) == ([], [])
    assert await store.fail_unloadable(me, [t]) == []  # nor failed while owned
    assert [f.id for f in (await store.reap_dead([A], max_failures=5)).freed] == [t]
    assert await store.fail_unloadable(me, [t]) == [t]
    task = await backend.task(t)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    assert "no module x" in str(task.next_kwargs)


async def test_an_airflow_trigger_without_a_deferred_task_is_never_claimed(
    backend: Backend,
) -> None:
    only(backend, "airflow", why="only Airflow's trigger table holds rows that are no task's "
                                 "deferral (asset watchers, callbacks, tasks cleared by hand); "
                                 "native triggers always are one, and the sweep drops the rest")
    await backend.defer(A)  # another task, still deferred
    t = await backend.defer(A)
    await backend.end_task(t, "success")
    me = await register(backend, [A], ttl=300)
    found = await backend.store.claim(me, [t], [A])
    assert (found.claimed, found.suspects, found.refused) == ([], [], [])


async def test_taken_since_names_my_latest_claims_at_their_attempts(backend: Backend) -> None:
    """What a claim whose reply was lost may have made mine: my rows claimed lately only."""
    store = backend.store
    early, late, theirs = [await backend.defer(A) for _ in range(3)]
    me = await register(backend, [A], ttl=300)
    other = await register(backend, [A], ttl=300)
    await store.claim(me, [early], [A])
    await backend.travel(30)
    [spec] = (await store.claim(me, [late], [A])).claimed
    await store.claim(other, [theirs], [A])

    assert await store.taken_since(me, 10) == [(late, spec.attempt)]
    assert sorted(await store.taken_since(me, 60)) == [(early, 1), (late, 1)]
    assert await store.taken_since(other, 10) == [(theirs, 1)]
    await store.release(me, [late])
    assert await store.taken_since(me, 10) == []  # not mine any more
