"""A change another process commits while a statement waits on the row it changed: the
statement's snapshot predates the commit, so only its re-check of the locked row (READ
COMMITTED re-evaluates an UPDATE's or DELETE's conditions on the row's newest version) keeps
it from undoing that change. Every store; a serial one runs the other change first."""

from __future__ import annotations

from tests.contract.backends import Backend, register
from tests.contract.conftest import only
from tests.contract.events import event
from tests.contract.test_failover import TTL, dies_holding
from triggerflow.store import Store

A = "team-a"


async def test_a_reaper_leaves_a_trigger_claimed_while_it_waited_on_the_row(
    backend: Backend,
) -> None:
    store = backend.store
    t = await backend.defer(A)
    witness = await register(backend, [A], TTL)
    await dies_holding(backend, [t], witness)
    claimer = await register(backend, [A], TTL)

    async def claim(other: Store) -> None:
        assert [s.id for s in (await other.claim(claimer, [t], [A])).claimed] == [t]

    reaped = await backend.race(claim, lambda: store.reap_dead([A], max_failures=5))
    assert reaped.freed == []  # the claim stands: neither freed nor blamed
    third = await register(backend, [A], TTL)
    assert (await store.claim(third, [t], [A])).claimed == []
    assert len(await store.apply_events([event(t, 2, A)])) == 1  # the claimer's attempt


async def test_an_old_event_leaves_a_task_deferred_again_while_it_waited_on_the_row(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="in Airflow mode a task is deferred again through Airflow, not the Store")
    store = backend.store
    t = await backend.defer(A)
    me = await register(backend, [A], TTL)
    await store.claim(me, [t], [A])
    again: list[int] = []

    async def defer_again(other: Store) -> None:
        again.append(await backend.defer_again(t, other))  # type: ignore[attr-defined]

    assert await backend.race(defer_again, lambda: store.apply_events([event(t, 1, A)])) == []
    assert (await backend.task(t)).state == "deferred"  # waiting on the new trigger
    await store.claim(me, again, [A])
    assert len(await store.apply_events([event(again[0], 1, A)])) == 1
    assert (await backend.task(t)).state == "scheduled"


async def test_a_claim_meeting_a_claim_that_commits_meanwhile_takes_nothing(
    backend: Backend,
) -> None:
    store = backend.store
    t = await backend.defer(A)  # never claimed: in Airflow, no bookkeeping row yet either
    first, second = await register(backend, [A], TTL), await register(backend, [A], TTL)

    async def claim(other: Store) -> None:
        assert [s.id for s in (await other.claim(first, [t], [A])).claimed] == [t]

    found = await backend.race(claim, lambda: store.claim(second, [t], [A]))
    assert (found.claimed, found.suspects, found.refused) == ([], [], [])
    assert len(await store.apply_events([event(t, 1, A)])) == 1  # the first claim's attempt


async def test_a_sweep_leaves_a_trigger_freed_while_it_waited_on_the_row(
    backend: Backend,
) -> None:
    """My late sweep finds my trigger's task ended while a reaper frees the trigger from my
    expired lease: the trigger is no longer mine to drop, the reaper's freeing stands."""
    only(backend, "memory", "postgres",
         why="Airflow mode's sweep names a superset of what the owner runs and drops no "
             "trigger (test_the_cancel_sweep_drops_what_its_owner_holds_for_ended_tasks)")
    store = backend.store
    t = await backend.defer(A)
    witness = await register(backend, [A], TTL)
    me = await dies_holding(backend, [t], witness)
    await backend.end_task(t, "success")  # an operator ended the task: a sweep would drop it
    freed: list[int] = []

    async def reap(other: Store) -> None:
        freed.extend(f.id for f in (await other.reap_dead([A], max_failures=5)).freed)

    assert await backend.race(reap, lambda: store.sweep_cancelled(me)) == []
    assert freed == [t]
