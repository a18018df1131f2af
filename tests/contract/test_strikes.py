"""Strikes against a trigger that blocked its consumer's event loop: counted with the losses,
freed below ``max_failures``, quarantined at it naming the class and the block, and applied
by (id, attempt) even when the striking consumer's lease expired meanwhile. Every store."""

from __future__ import annotations

from tests.contract.backends import Backend, register
from tests.contract.test_failover import TTL, freed, live_through

A, B = "team-a", "team-b"


def failure_text(next_kwargs: dict[str, str | list[str]]) -> str:
    """The reason a failed task carries: native ``message``, Airflow's ``traceback``."""
    text = next_kwargs.get("message") or next_kwargs["traceback"][0]
    assert isinstance(text, str)
    return text


async def test_a_strike_frees_the_trigger_and_max_failures_strikes_quarantine_it(
    backend: Backend,
) -> None:
    store = backend.store
    await backend.defer(B)  # the first row of the table: a strike reports its own trigger's queue
    t, neighbour, ended = [await backend.defer(A) for _ in range(3)]
    me = await register(backend, [A], TTL)
    await store.claim(me, [t, neighbour, ended], [A])

    struck = await store.strike(me, t, 1, 1.24, max_failures=3)
    assert struck is not None
    assert (struck.id, struck.queue, struck.failures, struck.quarantined) == (t, A, 1, False)
    assert (await backend.task(t)).state == "deferred"
    assert await store.strike(me, t, 1, 1.2, max_failures=3) is None  # counted once
    # Freed: claimed again (by anyone) past the struck attempt; the neighbour stays mine.
    other = await register(backend, [A], TTL)
    assert [(s.id, s.attempt) for s in (await store.claim(other, [t, neighbour], [A])).claimed] \
        == [(t, 3)]
    assert await store.strike(me, t, 3, 1.2, max_failures=3) is None  # not mine: another's run
    assert await store.strike(other, t, 2, 1.2, max_failures=3) is None  # a stale attempt
    assert (await store.strike(other, t, 3, 2.0, max_failures=3)) is not None
    # Two failures: a suspect, run on probation, where the third strike quarantines it.
    assert (await store.claim(other, [t], [A])).suspects == [t]
    [spec] = await store.claim_probation(other, [A])
    struck = await store.strike(other, t, spec.attempt, 8.04, max_failures=3)
    assert struck is not None and (struck.failures, struck.quarantined) == (3, True)

    task = await backend.task(t)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    reason = failure_text(task.next_kwargs)
    assert struck.classpath in reason and "blocked the event loop for 8.0 s" in reason
    assert (await store.claim(other, [t], [A])).claimed == []
    assert await store.resend_unclaimed([A], 0, 10) == []  # never re-sent
    assert await store.strike(other, t, spec.attempt, 1.0, max_failures=3) is None
    assert (await backend.task(neighbour)).state == "deferred"
    # A task that already left deferred is not moved by the quarantine.
    await backend.end_task(ended, "success")
    struck = await store.strike(me, ended, 1, 1.0, max_failures=1)
    assert struck is not None and struck.quarantined
    assert (await backend.task(ended)).state == "success"


async def test_a_strike_lands_after_the_strikers_lease_expired_even_once_reaped(
    backend: Backend,
) -> None:
    """The block outlasted the lease: the strike is recorded whether or not a peer's reaper
    has freed the row yet, and not once a peer has claimed it again."""
    store = backend.store
    unreaped, reaped, retaken = [await backend.defer(A) for _ in range(3)]
    witness = await register(backend, [A], TTL)
    blocked = await register(backend, [A], TTL)
    await store.claim(blocked, [unreaped, reaped, retaken], [A])
    await live_through(backend, 30, witness)  # blocked past its lease

    struck = await store.strike(blocked, unreaped, 1, 30.0, max_failures=5)
    assert struck is not None and (struck.failures, struck.quarantined) == (1, False)
    # The witness reaps the dead row: a loss blamed on each trigger it still held.
    assert freed(await store.reap_dead([A], max_failures=5)) == [(reaped, 1, False),
                                                                 (retaken, 1, False)]
    struck = await store.strike(blocked, reaped, 1, 30.0, max_failures=5)
    assert struck is not None and (struck.id, struck.failures) == (reaped, 2)
    assert [s.id for s in (await store.claim(witness, [retaken], [A])).claimed] == [retaken]
    assert await store.strike(blocked, retaken, 1, 30.0, max_failures=5) is None
    await backend.travel(1)
    assert [r.id for r in await store.resend_unclaimed([A], 0, 10)] == sorted([unreaped, reaped])


async def test_a_trigger_quarantined_meanwhile_takes_no_strike(backend: Backend) -> None:
    """The reaper quarantined it for the striker's own expiry: the late strike changes nothing."""
    store = backend.store
    t = await backend.defer(A)
    witness = await register(backend, [A], TTL)
    blocked = await register(backend, [A], TTL)
    await store.claim(blocked, [t], [A])
    await live_through(backend, 30, witness)
    assert freed(await store.reap_dead([A], max_failures=1)) == [(t, 1, True)]
    assert await store.strike(blocked, t, 1, 30.0, max_failures=5) is None
