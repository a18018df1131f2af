"""Dead owners: blame only for a witnessed death, probation in halves, quarantine, the
reaping consumer's take-over scope, and the orphan slack. Every store, the same cases."""

from __future__ import annotations

from typing import Protocol, cast

import pytest

from tests.contract.backends import Backend, MemoryBackend, register
from tests.contract.conftest import only
from tests.contract.events import event
from triggerflow.store import Taker, TriggerRef

A, B = "team-a", "team-b"
TTL = 20.0  # leases outlive any real pause of a loaded machine; time moves by travel


async def live_through(backend: Backend, seconds: float, *alive: int) -> None:
    """Let ``seconds`` pass while the ``alive`` consumers (of queue A) keep renewing."""
    left = seconds
    while left > 0:
        step = min(TTL / 2, left)
        await backend.travel(step)
        left -= step
        for me in alive:
            assert await backend.store.renew(me, TTL, 0, [A]) is not None


async def dies_holding(backend: Backend, ids: list[int], witness: int,
                       queues: list[str] | None = None) -> int:
    """A consumer that claims ``ids`` and dies while ``witness`` stays alive."""
    me = await register(backend, queues or [A], TTL)
    claimed = (await backend.store.claim(me, ids, queues or [A])).claimed
    assert sorted(s.id for s in claimed) == sorted(ids)
    await live_through(backend, 30, witness)
    return me


def freed(reaped: object) -> list[tuple[int, int, bool]]:
    return sorted((f.id, f.failures, f.quarantined) for f in reaped.freed)  # type: ignore[attr-defined]


async def test_witnessed_deaths_make_suspects_and_probation_finds_the_killer(
    backend: Backend,
) -> None:
    store = backend.store
    t1, t2 = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    for losses in (1, 2):
        await dies_holding(backend, [t1, t2], witness)
        reaped = await store.reap_dead([A], max_failures=5)
        assert reaped.dead_owners == 1
        assert freed(reaped) == [(t1, losses, False), (t2, losses, False)]

    # Lost twice: suspects, never claimed by an ordinary claim.
    prober = await register(backend, [A], TTL)
    found = await store.claim(prober, [t1, t2], [A])
    assert (found.claimed, sorted(found.suspects)) == ([], [t1, t2])
    [spec] = await store.claim_probation(prober, [A])  # half of them: the first
    assert (spec.id, spec.attempt) == (t1, 3)
    innocent = await backend.defer(A)  # held beside the group: not blamed for its death
    assert [s.id for s in (await store.claim(prober, [innocent], [A])).claimed] == [innocent]
    other = await register(backend, [A], TTL)
    held = await store.claim(other, [t1, t2], [A])
    assert (held.claimed, held.suspects) == ([], [t2])  # t1 runs on probation elsewhere

    # The prober dies with t1 alone on probation: t1 is the killer, quarantined at once.
    await live_through(backend, 30, witness, other)
    reaped = await store.reap_dead([A], max_failures=5)
    assert freed(reaped) == [(t1, 3, True), (innocent, 0, False)]
    task = await backend.task(t1)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    assert (await backend.task(t2)).state == "deferred"
    quarantined = await store.claim(other, [t1], [A])
    assert (quarantined.claimed, quarantined.suspects, quarantined.refused) == ([], [], [])
    assert [s.id for s in await store.claim_probation(other, [A])] == [t2]
    # It cannot load t2: passed on, not a suspect of its own, and not its to probe again.
    await store.release(other, [t2], cannot_load=True)
    passed = await store.claim(other, [t2], [A])
    assert (passed.claimed, passed.suspects, [r.id for r in passed.refused]) == ([], [], [t2])
    assert await store.claim_probation(other, [A]) == []
    third = await register(backend, [A], TTL)
    assert [s.id for s in await store.claim_probation(third, [A])] == [t2]
    await store.clear_probation(third, [t2])
    assert await store.release(third, [t2]) != []
    [spec] = (await store.claim(third, [t2], [A])).claimed  # cleared: an ordinary claim
    assert (spec.id, spec.attempt) == (t2, 5)
    assert (await backend.task(t2)).state == "deferred"


async def test_probation_takes_half_of_the_worst_waiting_suspects_of_its_queues(
    backend: Backend,
) -> None:
    store = backend.store
    ordinary = await backend.defer(A)  # waiting, never lost: not a suspect
    other_queue = await backend.defer(B)
    quarantined = await backend.defer(A)
    suspects = [await backend.defer(A) for _ in range(4)]
    witness = await register(backend, [A, B], TTL)
    await dies_holding(backend, [other_queue, quarantined, *suspects], witness, [A, B])
    await store.reap_dead(None, max_failures=5)
    await dies_holding(backend, [other_queue, *suspects], witness, [A, B])
    await store.reap_dead(None, max_failures=5)
    await dies_holding(backend, [quarantined], witness)
    assert freed(await store.reap_dead(None, max_failures=2)) == [(quarantined, 2, True)]

    prober = await register(backend, [A], TTL)
    assert [s.id for s in await store.claim_probation(prober, [A])] == suspects[:2]
    peer = await register(backend, [A], TTL)  # half of the two still waiting
    assert [s.id for s in await store.claim_probation(peer, [A])] == [suspects[2]]
    assert (await backend.task(ordinary)).state == "deferred"


async def test_a_trigger_blamed_max_failures_times_is_quarantined(backend: Backend) -> None:
    t, t2, ended = await backend.defer(A), await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    owner = await register(backend, [A], TTL)
    await backend.store.claim(owner, [t, t2, ended], [A])
    await backend.end_task(ended, "success")  # by hand, while its trigger still runs
    await live_through(backend, 30, witness)
    # A reaping consumer with room takes over nothing quarantined.
    reaped = await backend.store.reap_dead([A], max_failures=1, taker=Taker(witness, 10))
    assert reaped.taken == []
    assert freed(reaped) == [(t, 1, True), (t2, 1, True), (ended, 1, True)]
    for trigger_id in (t, t2):
        task = await backend.task(trigger_id)
        assert (task.state, task.next_method) == ("scheduled", "__fail__")
        if backend.name != "airflow":  # Airflow's failure reason names no trigger id
            assert f"trigger {trigger_id} " in task.next_kwargs["message"]
    assert (await backend.task(ended)).state == "success"  # not deferred: left alone
    assert (await backend.store.claim(witness, [t], [A])).claimed == []
    assert await backend.store.resend_unclaimed(None, 0, 10) == []  # never re-sent


async def test_a_quarantined_row_no_task_waits_on_goes(backend: Backend) -> None:
    """A row its task left (deferred again) is blamed like any other, but once quarantined
    nothing waits on it: it goes, and the task's new trigger is untouched."""
    only(backend, "memory", "postgres", why="Airflow's clean_unused (the writer runs it) "
                                           "drops a trigger row no task instance refers to")
    assert isinstance(backend, MemoryBackend)  # and its subclass NativeBackend
    store = backend.store
    left, kept = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    owner = await register(backend, [A], TTL)
    await store.claim(owner, [left, kept], [A])
    again = await backend.defer_again(left, store)  # the task now waits on `again`
    await live_through(backend, 30, witness)
    assert freed(await store.reap_dead([A], max_failures=1)) == [(left, 1, True), (kept, 1, True)]
    assert (await backend.task(again)).state == "deferred"
    assert (await backend.task(kept)).next_method == "__fail__"
    # `kept` stays quarantined, for `trigger release`; `left` is gone, not claimed or re-sent
    assert await backend.trigger_ids() == sorted([kept, again])
    assert [s.id for s in (await store.claim(witness, [left, kept, again], [A])).claimed] == [again]
    assert await store.resend_unclaimed(None, 0, 10) == []


async def test_a_death_nobody_witnessed_blames_no_trigger(backend: Backend) -> None:
    store = backend.store
    t = await backend.defer(A)
    # Alive throughout, but on a longer lease: its renewals prove nothing about a 2 s lease.
    long_lease = await register(backend, [A], ttl=600)
    owner = await register(backend, [A], TTL)
    await register(backend, [A], TTL)  # on the same lease, and expired with it
    await store.claim(owner, [t], [A])
    await backend.travel(30)  # the owner expires
    await register(backend, [A], TTL)  # alive now, but started after the owner expired
    reaped = await store.reap_dead([A], max_failures=1)
    assert reaped.dead_owners == 2
    assert freed(reaped) == [(t, 0, False)]
    assert await store.renew(long_lease, 600, 0, [A]) is not None
    assert (await backend.task(t)).state == "deferred"


async def test_reap_dead_reaps_only_owners_of_the_given_queues(backend: Backend) -> None:
    t = await backend.defer(B)
    witness = await register(backend, [A, B], TTL)
    owner = await register(backend, [B], TTL)
    await backend.store.claim(owner, [t], [B])
    await live_through(backend, 30, witness)
    assert (await backend.store.reap_dead([A], max_failures=5)).freed == []
    reaped = await backend.store.reap_dead(None, max_failures=5)
    assert [f.id for f in reaped.freed] == [t]


@pytest.mark.parametrize("room", [2, 10])
async def test_a_reaping_consumer_takes_over_only_what_it_may_run(
    backend: Backend, room: int,
) -> None:
    store = backend.store
    taker = await register(backend, [A], TTL)
    suspect = await backend.defer(A)
    await dies_holding(backend, [suspect], taker)  # lost once before: twice after this death
    await store.reap_dead([A], max_failures=5)
    refused = await backend.defer(A)
    await store.claim(taker, [refused], [A])
    await store.release(taker, [refused], cannot_load=True)
    mine = [await backend.defer(A) for _ in range(4)]
    theirs = await backend.defer(B)
    await dies_holding(backend, [*mine, theirs, refused, suspect], taker, [A, B])

    reaped = await store.reap_dead([A], max_failures=5, taker=Taker(taker, room))
    taken = mine[:room]
    assert sorted((s.id, s.attempt) for s in reaped.taken) == [(t, 2) for t in taken]
    assert sorted(f.id for f in reaped.freed) == sorted(
        [*mine[room:], theirs, refused, suspect])
    # Taken means owned by the taker at the raised attempt: nobody else claims them, and
    # the taker's events apply.
    other = await register(backend, [A], 300)
    assert (await store.claim(other, taken, [A])).claimed == []
    assert len(await store.apply_events([event(t, 2, A) for t in taken])) == len(taken)


async def test_a_take_over_leaves_a_row_whose_task_ended_to_the_clean_up(
    backend: Backend,
) -> None:
    only(backend, "airflow", why="a native consumer takes it over and its cancel sweep stops it; "
                                 "Airflow's claim and take-over take only rows with work")
    store = backend.store
    taker = await register(backend, [A], TTL)
    live, ended = await backend.defer(A), await backend.defer(A)
    await dies_holding(backend, [live, ended], taker)
    await backend.end_task(ended, "success")  # cleared or marked in Airflow's UI meanwhile
    reaped = await store.reap_dead([A], max_failures=5, taker=Taker(taker, 10))
    assert [(s.id, s.attempt) for s in reaped.taken] == [(live, 2)]
    assert all(s.kwargs is not None and s.task for s in reaped.taken)  # decoded, as claimed
    assert [f.id for f in reaped.freed] == [ended]


async def test_a_task_past_its_timeout_fails_only_after_the_orphan_slack(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="Airflow's scheduler times deferred tasks out (time_out_orphans does nothing)")
    store = backend.store
    t = await backend.defer(A, timeout=10)
    u = await backend.defer(B, timeout=10)
    owner = await register(backend, [A], 60)
    await store.claim(owner, [t], [A])  # held by a live owner: past its timeout all the same
    await backend.travel(11)
    assert await store.time_out_orphans(None, 3600) == []  # 1 s late: within the slack
    assert (await backend.task(t)).state == "deferred"
    await backend.travel(2)
    assert await store.time_out_orphans([A], 3600) == [TriggerRef(t, A)]  # of its queue only
    task = await backend.task(t)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    assert task.next_kwargs["error"] == "Trigger timeout"
    assert (await backend.task(u)).state == "deferred"
    assert await store.time_out_orphans(None, 3600) == [TriggerRef(u, B)]


async def test_orphans_timed_out_in_one_pass_each_drop_their_own_trigger(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="Airflow's scheduler times deferred tasks out (time_out_orphans does nothing)")
    store = backend.store
    orphans = [await backend.defer(A, timeout=10) for _ in range(3)]
    await backend.travel(13)
    assert sorted(r.id for r in await store.time_out_orphans([A], 3600)) == orphans
    for t in orphans:
        assert (await backend.task(t)).state == "scheduled"
    late = await register(backend, [A], TTL)  # every trigger is gone: nothing left to run
    assert (await store.claim(late, orphans, [A])).claimed == []


async def test_a_probation_claim_that_finds_nothing_records_an_empty_group(
    backend: Backend,
) -> None:
    store = backend.store
    suspect, ordinary = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    for _ in range(2):
        await dies_holding(backend, [suspect], witness)
        await store.reap_dead([A], max_failures=5)
    prober = await register(backend, [A], TTL)
    assert [s.id for s in await store.claim_probation(prober, [A])] == [suspect]
    await store.claim(prober, [ordinary], [A])  # seen, handed back: waiting, not suspect
    await store.release(prober, [ordinary])
    assert await store.claim_probation(prober, [A]) == []  # the group is now empty
    await store.claim(prober, [ordinary], [A])
    # It dies with no group on record: everything it held is blamed, nothing alone.
    await live_through(backend, 30, witness)
    reaped = await store.reap_dead([A], max_failures=5)
    assert freed(reaped) == [(suspect, 3, False), (ordinary, 1, False)]


async def test_reap_dead_frees_a_big_holder_in_batches_of_limit(backend: Backend) -> None:
    only(backend, "postgres", why="the memory and Airflow stores free everything at once "
                                  "(the protocol lets a store not batch)")
    held = [await backend.defer(A) for _ in range(3)]
    witness = await register(backend, [A], TTL)
    await dies_holding(backend, held, witness)
    first = await backend.store.reap_dead([A], max_failures=5, limit=2)
    assert (len(first.freed), first.dead_owners) == (2, 0)  # the dead row stays for the rest
    second = await backend.store.reap_dead([A], max_failures=5, limit=2)
    assert (len(second.freed), second.dead_owners) == (1, 1)
    assert sorted(f.id for f in [*first.freed, *second.freed]) == held


async def test_a_task_without_a_timeout_fails_after_max_deferral_unless_held(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="Airflow's scheduler times deferred tasks out (time_out_orphans does nothing)")
    untimed = cast("Untimed", backend)
    held, orphan = await backend.defer(A), await backend.defer(A)
    await untimed.untime(held)
    await untimed.untime(orphan)
    owner = await register(backend, [A], 600)
    await backend.store.claim(owner, [held], [A])
    await backend.travel(50)
    assert await backend.store.time_out_orphans([A], 100) == []  # within max_deferral
    await backend.travel(60)
    assert await backend.store.time_out_orphans([A], 100) == [TriggerRef(orphan, A)]  # the held one runs
    assert (await backend.task(held)).state == "deferred"
    await backend.travel(600)  # its owner is gone now
    assert await backend.store.time_out_orphans([A], 100) == [TriggerRef(held, A)]


class Untimed(Protocol):
    async def untime(self, trigger_id: int) -> None: ...
