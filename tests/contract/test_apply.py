"""What an event does to its task, bad content, stored kwargs nobody (or not this process)
can read, the backstop's queries, cancellation and the cancel sweep. Every store."""

from __future__ import annotations

import pytest

from tests.contract.backends import NEXT_KWARGS, Backend, register
from tests.contract.conftest import only
from tests.contract.events import PAYLOAD, event
from triggerflow.store import EventRefused, KwargsProblem, ProcessKind, TriggerRef

A, B = "team-a", "team-b"


async def claimed(backend: Backend, queue: str = A) -> tuple[int, int]:
    """A deferred trigger claimed by a live consumer: (trigger id, owner)."""
    t = await backend.defer(queue)
    me = await register(backend, [queue], ttl=600)
    assert [s.id for s in (await backend.store.claim(me, [t], [queue])).claimed] == [t]
    return t, me


async def held_elsewhere(backend: Backend, me: int) -> int:
    """One more trigger ``me`` holds, whose task stays deferred."""
    t = await backend.defer(A)
    assert [s.id for s in (await backend.store.claim(me, [t], [A])).claimed] == [t]
    return t


async def test_resume_schedules_the_task_with_the_event_payload(backend: Backend) -> None:
    t, _ = await claimed(backend)
    [applied] = await backend.store.apply_events([event(t, 1, A)])
    assert (applied.kind, applied.queue) == ("resume", A)
    assert applied.latency >= 0
    task = await backend.task(t)
    assert (task.state, task.next_method) == ("scheduled", "execute_complete")
    assert task.next_kwargs == {**NEXT_KWARGS, "event": PAYLOAD}


async def test_fail_schedules_the_task_into_fail_method(backend: Backend) -> None:
    t, _ = await claimed(backend)
    body = {"error": "Trigger failure", "traceback": ["boom"]}
    assert len(await backend.store.apply_events([event(t, 1, A, "fail", body)])) == 1
    task = await backend.task(t)
    assert (task.state, task.next_method, task.next_kwargs) == ("scheduled", "__fail__", body)


@pytest.mark.parametrize("kind", ["success", "failed", "skipped"])
async def test_a_task_end_event_ends_the_task(backend: Backend, kind: str) -> None:
    t, _ = await claimed(backend)
    [applied] = await backend.store.apply_events([event(t, 1, A, kind, None)])
    assert applied.kind == kind
    assert (await backend.task(t)).state == kind


async def test_an_unknown_kind_changes_nothing_and_keeps_the_trigger(backend: Backend) -> None:
    t, _ = await claimed(backend)
    assert await backend.store.apply_events([event(t, 1, A, "scheduled")]) == []
    assert (await backend.task(t)).state == "deferred"
    assert len(await backend.store.apply_events([event(t, 1, A)])) == 1  # still there


async def test_bad_content_refuses_the_whole_batch(backend: Backend) -> None:
    t, _ = await claimed(backend)
    u, _ = await claimed(backend)
    with pytest.raises(EventRefused):
        await backend.store.apply_events([event(t, 1, A), event(u, 1, A, payload="{not json")])
    assert (await backend.task(t)).state == "deferred"  # one transaction: nothing applied
    assert len(await backend.store.apply_events([event(t, 1, A)])) == 1


async def test_an_event_for_a_task_no_longer_deferred_moves_nothing(backend: Backend) -> None:
    t, _ = await claimed(backend)
    await backend.end_task(t, "success")
    assert await backend.store.apply_events([event(t, 1, A)]) == []
    assert (await backend.task(t)).state == "success"


@pytest.mark.parametrize("problem", [KwargsProblem.UNREADABLE_HERE, KwargsProblem.INVALID])
async def test_kwargs_problems_come_back_with_the_claim(backend: Backend,
                                                        problem: KwargsProblem) -> None:
    stored = (backend.unreadable_kwargs if problem is KwargsProblem.UNREADABLE_HERE
              else backend.invalid_kwargs)
    t = await backend.defer(A, stored_kwargs=stored)
    me = await register(backend, [A], ttl=600)
    [spec] = (await backend.store.claim(me, [t], [A])).claimed
    assert spec.kwargs is None
    assert spec.kwargs_error is not None and spec.kwargs_error.problem is problem


async def test_the_backstop_resends_unclaimed_triggers_of_its_scope_once(
    backend: Backend,
) -> None:
    store = backend.store
    a1, a2, b1 = await backend.defer(A), await backend.defer(A), await backend.defer(B)
    held, _ = await claimed(backend)
    assert await store.resend_unclaimed(None, 5, 100) == []  # within the grace
    assert await store.waiting_queues(5) == []
    await backend.travel(6)
    assert sorted(await store.waiting_queues(5)) == [A, B]
    assert len(await store.resend_unclaimed([A], 5, 1)) == 1  # the limit
    rest = await store.resend_unclaimed([A], 5, 100)
    assert len(rest) == 1 and rest[0].id in (a1, a2)
    assert await store.resend_unclaimed([A], 5, 100) == []  # marked dispatched
    assert await store.resend_unclaimed(None, 5, 100) == [TriggerRef(b1, B)]
    assert await store.waiting_queues(5) == []
    assert held not in {a1, a2, b1}


async def test_queue_consumers_counts_live_consumers_only(backend: Backend) -> None:
    store = backend.store
    await register(backend, [A], ttl=20)
    await register(backend, [A, B], ttl=600)
    await register(backend, [A], ttl=60, kind=ProcessKind.WRITER)
    assert await store.queue_consumers([A, B, "team-c"]) == {A: 2, B: 1, "team-c": 0}
    await backend.travel(30)
    assert await store.queue_consumers([A, B]) == {A: 1, B: 1}


async def test_the_cancel_sweep_drops_what_its_owner_holds_for_ended_tasks(
    backend: Backend,
) -> None:
    # Airflow mode reads Airflow's cancel log, which is not keyed by owner and is read again
    # with an overlap (airflow/cancels.py): it names at least the owner's ended tasks, and
    # the consumer stops only those it runs (consumer/cancel.py). The others name exactly.
    exact = backend.name != "airflow"

    async def swept(owner: int, *expected: int) -> None:
        got = await backend.store.sweep_cancelled(owner)
        assert (got == list(expected)) if exact else set(expected) <= set(got), got

    t, me = await claimed(backend)
    u, other = await claimed(backend)
    await held_elsewhere(backend, me)
    assert await backend.store.sweep_cancelled(me) == []
    await backend.end_task(t, "success")
    await backend.end_task(u, "success")
    await swept(me, t)  # only mine
    if exact:
        assert await backend.store.sweep_cancelled(me) == []
    await backend.end_task(u, "deferred")  # an operator put it back: it waits again
    if exact:
        assert await backend.store.sweep_cancelled(other) == []
    await backend.end_task(u, "success")
    await swept(other, u)


async def test_cancel_moves_the_task_and_drops_unowned_triggers_at_once(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="in Airflow mode tasks are cleared or marked through Airflow (no DeferralStore role)")
    store = backend.store
    free = await backend.defer(A)
    orphaned = await backend.defer(A)
    dying = await register(backend, [A], ttl=20)
    await store.claim(dying, [orphaned], [A])
    await backend.travel(30)  # its owner is dead: nobody runs it
    held, owner = await claimed(backend)
    loose, (busy, _) = await backend.defer(A), await claimed(backend)  # not cancelled
    result = sorted(await store.cancel([free, orphaned, held], "removed"), key=lambda c: c.id)
    assert [(c.id, c.owner, c.moved) for c in result] == [
        (free, None, True), (orphaned, None, True), (held, owner, True)]
    for cancelled in (free, orphaned, held):
        assert (await backend.task(cancelled)).state == "removed"
    for bystander in (loose, busy):
        assert (await backend.task(bystander)).state == "deferred"
    # The unowned ones are gone; the held one waits for its owner (control message or sweep).
    peer = await register(backend, [A], ttl=600)
    found = await store.claim(peer, [free, orphaned, loose], [A])
    assert [s.id for s in found.claimed] == [loose]
    assert await store.sweep_cancelled(owner) == [held]
    assert await store.cancel([free, orphaned, held], "removed") == []


async def test_an_id_named_twice_is_cancelled_once(backend: Backend) -> None:
    only(backend, "memory", "postgres",
         why="in Airflow mode tasks are cleared or marked through Airflow (no DeferralStore role)")
    held, owner = await claimed(backend)
    free = await backend.defer(A)
    result = sorted(await backend.store.cancel([held, free, held, free], "removed"),
                    key=lambda c: c.id)
    assert [(c.id, c.owner, c.moved) for c in result] == sorted(
        [(held, owner, True), (free, None, True)])


async def test_cancelling_a_task_that_already_left_deferred_moves_nothing(
    backend: Backend,
) -> None:
    only(backend, "memory", "postgres",
         why="in Airflow mode tasks are cleared or marked through Airflow (no DeferralStore role)")
    t = await backend.defer(A)
    await backend.end_task(t, "success")
    assert [(c.id, c.owner, c.moved) for c in await backend.store.cancel([t], "removed")] == [
        (t, None, False)]
    assert (await backend.task(t)).state == "success"


async def test_a_stale_event_is_ignored_whatever_its_content(backend: Backend) -> None:
    t, _ = await claimed(backend)
    assert await backend.store.apply_events([event(t, 2, A, payload="{not json")]) == []
    assert await backend.store.apply_events([event(t, 1, B, payload="{not json")]) == []
    assert (await backend.task(t)).state == "deferred"


async def test_a_resume_moves_a_task_that_may_still_be_retried(backend: Backend) -> None:
    only(backend, "airflow", why="only Airflow's tasks carry retries into the apply (a "
                                 "failure with retries left is Airflow's own decision)")
    from tests.contract.airflow_backend import AirflowBackend

    t, _ = await claimed(backend)
    assert isinstance(backend, AirflowBackend)
    await backend.allow_retries(t, 2)
    assert len(await backend.store.apply_events([event(t, 1, A)])) == 1
    assert (await backend.task(t)).state == "scheduled"


async def test_only_the_first_event_of_an_attempt_in_a_batch_is_read(backend: Backend) -> None:
    """A batch naming one attempt twice: the first event moves the task, the later one is
    neither applied nor read (its bad content refuses nothing). Found by the model-based
    test (test_model.py): the memory store read every event and refused the batch."""
    only(backend, "memory", "postgres",
         why="Airflow mode hands an attempt's later events on (asset watchers, callbacks)")
    t, _ = await claimed(backend)
    applied = await backend.store.apply_events(
        [event(t, 1, A), event(t, 1, A, "fail", payload="{not json")])
    assert [(a.kind, a.queue) for a in applied] == [("resume", A)]
    assert (await backend.task(t)).next_kwargs == {**NEXT_KWARGS, "event": PAYLOAD}


async def test_a_trigger_handed_back_on_unregister_is_resent_at_once(backend: Backend) -> None:
    """A consumer that leaves hands back what it holds dated for the backstop's next sweep,
    however young the deferral (Airflow mode waited the grace from ``created_date``)."""
    t = await backend.defer(A)
    me = await register(backend, [A], ttl=600)
    assert [s.id for s in (await backend.store.claim(me, [t], [A])).claimed] == [t]
    await backend.store.unregister(me)
    assert await backend.store.resend_unclaimed([A], 15, 100) == [TriggerRef(t, A)]
