"""Strikes against a trigger that blocked its consumer's event loop: counted per run, apart
from the losses, whoever holds the trigger when the strike lands (a peer takes it over while
the blocked loop cannot renew its lease), only by a consumer of its queue; freed while the
struck run still holds it, quarantined at ``max_blocks`` naming the class and the block. A
reaper that finds a known blocker on a dead consumer blames it alone. Every store."""

from __future__ import annotations

from tests.contract.backends import Backend, register
from tests.contract.test_failover import TTL, freed, live_through
from triggerflow.store import Taker

A, B = "team-a", "team-b"


def failure_text(next_kwargs: dict[str, str | list[str]]) -> str:
    """The reason a failed task carries: native ``message``, Airflow's ``traceback``."""
    text = next_kwargs.get("message") or next_kwargs["traceback"][0]
    assert isinstance(text, str)
    return text


async def test_a_strike_frees_the_trigger_and_max_blocks_strikes_quarantine_it(
    backend: Backend,
) -> None:
    store = backend.store
    await backend.defer(B)  # the first row of the table: a strike reports its own trigger's queue
    t, neighbour, ended = [await backend.defer(A) for _ in range(3)]
    me = await register(backend, [A], TTL)
    await store.claim(me, [t, neighbour, ended], [A])

    struck = await store.strike(me, t, 1, 1.24, 3, [A])
    assert struck is not None
    assert (struck.id, struck.queue, struck.blocks, struck.quarantined, struck.freed) == (
        t, A, 1, False, True)
    assert (await backend.task(t)).state == "deferred"
    assert await store.strike(me, t, 1, 1.2, 3, [A]) is None  # a run counts once
    assert await store.strike(me, t, 9, 1.2, 3, [A]) is None  # a run it never had
    # Freed: claimed again (by anyone) past the struck attempt; the neighbour stays mine.
    other = await register(backend, [A], TTL)
    assert [(s.id, s.attempt) for s in (await store.claim(other, [t, neighbour], [A])).claimed] \
        == [(t, 3)]
    struck = await store.strike(other, t, 3, 2.0, 3, [A])
    assert struck is not None and (struck.blocks, struck.freed, struck.quarantined) == (
        2, True, False)
    # Blocked runs are no losses: not a suspect, claimed as usual, and probation never clears them.
    [spec] = (await store.claim(other, [t], [A])).claimed
    await store.clear_probation(other, [t])
    struck = await store.strike(other, t, spec.attempt, 8.04, 3, [A])
    assert struck is not None and (struck.blocks, struck.quarantined, struck.freed) == (
        3, True, False)

    task = await backend.task(t)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    reason = failure_text(task.next_kwargs)
    assert struck.classpath in reason and "blocked the event loop for 8.0 s" in reason
    assert (await store.claim(other, [t], [A])).claimed == []
    assert await store.resend_unclaimed([A], 0, 10) == []  # never re-sent
    assert await store.strike(other, t, spec.attempt, 1.0, 3, [A]) is None
    assert (await backend.task(neighbour)).state == "deferred"
    # A task that already left deferred is not moved by the quarantine.
    await backend.end_task(ended, "success")
    struck = await store.strike(me, ended, 1, 1.0, 1, [A])
    assert struck is not None and struck.quarantined
    assert (await backend.task(ended)).state == "success"


async def test_a_strike_counts_after_a_peer_took_the_trigger_over(backend: Backend) -> None:
    """The fleet case: the block outlasted the lease and a peer took the blocker over at a
    raised attempt (and ran it) before the strike of the blocked run landed. The strike
    counts all the same and leaves the peer's run alone; the block that quarantines it does
    so whoever holds it (the peer's copy can no longer fire)."""
    store = backend.store
    t = await backend.defer(A)
    blocked = await register(backend, [A], TTL)
    peer = await register(backend, [A], TTL)
    await store.claim(blocked, [t], [A])
    await live_through(backend, 30, peer)  # blocked past its lease
    reaped = await store.reap_dead([A], 30, taker=Taker(peer, 10))
    assert [s.id for s in reaped.taken] == [t]

    struck = await store.strike(blocked, t, 1, 30.0, 2, [A])
    assert struck is not None and (struck.blocks, struck.freed, struck.quarantined) == (
        1, False, False)
    assert (await store.claim(blocked, [t], [A])).claimed == []  # still the peer's run
    struck = await store.strike(peer, t, 2, 30.0, 2, [A])  # the peer's run, blocked in turn
    assert struck is not None and struck.quarantined
    assert "blocked the event loop" in failure_text((await backend.task(t)).next_kwargs)


async def test_a_consumer_strikes_only_triggers_of_its_own_queues(backend: Backend) -> None:
    """Every team is hostile: a consumer of A cannot charge (let alone quarantine) B's rows,
    whichever id and attempt it names."""
    store = backend.store
    theirs = await backend.defer(B)
    owner = await register(backend, [B], TTL)
    await store.claim(owner, [theirs], [B])
    attacker = await register(backend, [A], TTL)
    for attempt in (0, 1):
        assert await store.strike(attacker, theirs, attempt, 9.0, 1, [A]) is None
    assert (await backend.task(theirs)).state == "deferred"
    struck = await store.strike(owner, theirs, 1, 1.5, 5, [B])
    assert struck is not None and struck.blocks == 1  # nothing was counted before


async def test_a_reaper_blames_a_known_blocker_alone_and_counts_its_run(backend: Backend) -> None:
    """A consumer that died holding a trigger with a counted block was stalled by it: the
    innocents it held are taken over uncharged, the blocker's run counts as a block (once,
    whatever the strike of that run does later), and at max_blocks it is quarantined."""
    store = backend.store
    blocker, innocent = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    first = await register(backend, [A], TTL)
    await store.claim(first, [blocker], [A])
    struck = await store.strike(first, blocker, 1, 1.5, 3, [A])  # a block within the lease
    assert struck is not None and struck.freed
    second = await register(backend, [A], TTL)
    await store.claim(second, [blocker, innocent], [A])
    await live_through(backend, 30, witness, first)  # second stalled by it past its lease

    # max_failures 1: a loss blamed on anyone would quarantine it.
    reaped = await store.reap_dead([A], 1, taker=Taker(witness, 10), max_blocks=3)
    assert freed(reaped) == []
    assert sorted(s.id for s in reaped.taken) == sorted([blocker, innocent])
    [run] = [s.attempt for s in reaped.taken if s.id == blocker]
    assert await store.strike(second, blocker, run - 1, 9.0, 3, [A]) is None  # counted already
    # The witness is stalled by it in turn: the third blocked run quarantines it.
    await live_through(backend, 30, first)
    reaped = await store.reap_dead([A], 1, taker=Taker(first, 10), max_blocks=3)
    assert freed(reaped) == [(blocker, 0, True)]
    assert [s.id for s in reaped.taken] == [innocent]
    task = await backend.task(blocker)
    assert (task.state, task.next_method) == ("scheduled", "__fail__")
    reason = failure_text(task.next_kwargs)
    assert struck.classpath in reason and "blocked the event loop" in reason
    assert "(3 runs blocked)" in reason
    assert (await backend.task(innocent)).state == "deferred"


async def test_a_trigger_quarantined_meanwhile_takes_no_strike(backend: Backend) -> None:
    """The reaper quarantined it for the striker's own expiry: the late strike changes nothing."""
    store = backend.store
    t = await backend.defer(A)
    witness = await register(backend, [A], TTL)
    blocked = await register(backend, [A], TTL)
    await store.claim(blocked, [t], [A])
    await live_through(backend, 30, witness)
    assert freed(await store.reap_dead([A], max_failures=1)) == [(t, 1, True)]
    assert await store.strike(blocked, t, 1, 30.0, 5, [A]) is None
