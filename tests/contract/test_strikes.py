"""Strikes against a trigger that blocked its consumer's event loop: counted per run, apart
from the losses, whoever holds the trigger when the strike lands (a peer takes it over while
the blocked loop cannot renew its lease), only by a consumer of its queue; freed while the
struck run still holds it, quarantined at ``max_blocks`` naming the class and the block. A
reaper that finds a known blocker on a dead consumer blames it alone. Every store."""

from __future__ import annotations

from tests.contract.backends import Backend, MemoryBackend, register
from tests.contract.conftest import only
from tests.contract.events import event
from tests.contract.test_failover import TTL, dies_holding, freed, live_through
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


async def test_a_strike_frees_the_struck_run_only_while_nobody_else_runs_it(
    backend: Backend,
) -> None:
    """A row still at the struck run that I handed back is freed all the same (re-sent at a
    raised attempt); a later run, even my own, is counted against but left running."""
    store = backend.store
    t = await backend.defer(A)
    me = await register(backend, [A], TTL)
    await store.claim(me, [t], [A])
    assert [r.id for r in await store.release(me, [t])] == [t]  # nobody's, still at run 1
    struck = await store.strike(me, t, 1, 2.0, 5, [A])
    assert struck is not None and (struck.blocks, struck.freed) == (1, True)
    [spec] = (await store.claim(me, [t], [A])).claimed
    assert spec.attempt == 3  # past the run the strike freed it at

    struck = await store.strike(me, t, 2, 2.0, 5, [A])  # an earlier run than the one I hold
    assert struck is not None and (struck.blocks, struck.freed) == (2, False)
    other = await register(backend, [A], TTL)
    assert (await store.claim(other, [t], [A])).claimed == []  # still mine, at run 3
    assert len(await store.apply_events([event(t, 3, A)])) == 1


async def test_a_quarantining_strike_takes_the_trigger_from_the_peer_that_runs_it(
    backend: Backend,
) -> None:
    """The blocked run's strike lands after a peer took the trigger over, and quarantines it:
    the peer holds it no more, so the peer's own death later frees (and revives) nothing."""
    store = backend.store
    t = await backend.defer(A)
    blocked = await register(backend, [A], TTL)
    peer = await register(backend, [A], TTL)
    await store.claim(blocked, [t], [A])
    await live_through(backend, 30, peer)  # blocked past its lease
    reaped = await store.reap_dead([A], 30, taker=Taker(peer, 10))
    assert [s.id for s in reaped.taken] == [t]

    struck = await store.strike(blocked, t, 1, 30.0, 1, [A])
    assert struck is not None and (struck.quarantined, struck.freed) == (True, False)
    witness = await register(backend, [A], TTL)
    await live_through(backend, 30, witness)  # the peer dies in turn
    assert await store.renew(peer, TTL, 1, [A]) is None
    reaped = await store.reap_dead([A], 30, taker=Taker(witness, 10))
    assert (reaped.freed, reaped.taken) == ([], [])
    assert (await store.claim(witness, [t], [A])).claimed == []  # still quarantined


async def test_a_blocker_a_live_peer_runs_excuses_no_other_death(backend: Backend) -> None:
    """Stalled means by a blocker of its own: a known blocker that a live peer runs does not
    spare a consumer that died holding other triggers; they are blamed as usual."""
    store = backend.store
    blocker, t = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    await store.claim(witness, [blocker], [A])
    struck = await store.strike(witness, blocker, 1, 1.5, 3, [A])
    assert struck is not None and struck.freed
    assert [s.id for s in (await store.claim(witness, [blocker], [A])).claimed] == [blocker]
    await dies_holding(backend, [t], witness)
    assert freed(await store.reap_dead([A], max_failures=5)) == [(t, 1, False)]


async def test_a_death_nobody_witnessed_counts_no_block_either(backend: Backend) -> None:
    """An outage fenced everyone: the known blocker the dead consumer held is not blamed, so
    the run it was in is not counted as blocked; its own strike counts it when it lands."""
    store = backend.store
    t = await backend.defer(A)
    first = await register(backend, [A], TTL)
    await store.claim(first, [t], [A])
    struck = await store.strike(first, t, 1, 1.5, 3, [A])
    assert struck is not None and struck.freed
    second = await register(backend, [A], TTL)
    [spec] = (await store.claim(second, [t], [A])).claimed
    await backend.travel(30)  # every lease ends: nobody stayed alive across it

    reaped = await store.reap_dead([A], max_failures=1, max_blocks=2)
    assert freed(reaped) == [(t, 0, False)]
    struck = await store.strike(second, t, spec.attempt, 1.5, 3, [A])
    assert struck is not None and struck.blocks == 2


async def test_a_blamed_blocker_is_no_loss_and_is_taken_over(backend: Backend) -> None:
    """A known blocker's blamed run counts as a block, not a loss, and the innocent it
    stalled is not blamed: each lost once before, neither is a suspect after it, and the
    reaping consumer takes both over like any trigger."""
    store = backend.store
    t, innocent = await backend.defer(A), await backend.defer(A)
    witness = await register(backend, [A], TTL)
    await dies_holding(backend, [t, innocent], witness)
    reaped = await store.reap_dead([A], max_failures=5)
    assert freed(reaped) == [(t, 1, False), (innocent, 1, False)]  # one loss each
    striker = await register(backend, [A], TTL)
    [spec] = (await store.claim(striker, [t], [A])).claimed
    struck = await store.strike(striker, t, spec.attempt, 1.5, 3, [A])
    assert struck is not None and struck.freed
    await dies_holding(backend, [t, innocent], witness)  # stalled by it past its lease

    reaped = await store.reap_dead([A], max_failures=5, taker=Taker(witness, 10))
    assert freed(reaped) == []
    assert sorted(s.id for s in reaped.taken) == [t, innocent]


async def test_a_run_struck_under_a_new_registration_is_counted_once(backend: Backend) -> None:
    """The stalled consumer registered again and its strike landed before a reaper found the
    old lease holding the trigger: the reaper blames the blocker without counting that run
    a second time."""
    store = backend.store
    t = await backend.defer(A)
    witness = await register(backend, [A], TTL)
    old = await register(backend, [A], TTL)
    [spec] = (await store.claim(old, [t], [A])).claimed
    await live_through(backend, 30, witness)  # its loop blocked past its lease
    new = await register(backend, [A], TTL)
    struck = await store.strike(new, t, spec.attempt, 30.0, 3, [A])
    assert struck is not None and (struck.blocks, struck.freed) == (1, False)  # old holds it

    reaped = await store.reap_dead([A], max_failures=5, max_blocks=3)
    assert freed(reaped) == [(t, 0, False)]  # a block, not a loss
    [again] = (await store.claim(new, [t], [A])).claimed
    struck = await store.strike(new, t, again.attempt, 1.0, 3, [A])
    assert struck is not None and (struck.blocks, struck.quarantined) == (2, False)


async def test_a_blocker_no_task_waits_on_goes_once_quarantined(backend: Backend) -> None:
    """Struck to quarantine after its task deferred again: nothing waits on the row, so it
    goes (the task's new trigger untouched)."""
    only(backend, "memory", "postgres", why="Airflow's clean_unused (the writer runs it) "
                                           "drops a trigger row no task instance refers to")
    assert isinstance(backend, MemoryBackend)
    store = backend.store
    t = await backend.defer(A)
    me = await register(backend, [A], TTL)
    await store.claim(me, [t], [A])
    again = await backend.defer_again(t, store)
    struck = await store.strike(me, t, 1, 8.04, 1, [A])
    assert struck is not None and struck.quarantined
    assert await backend.trigger_ids() == [again]
    assert (await backend.task(again)).state == "deferred"
