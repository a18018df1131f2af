"""The store by role: each loop depends on the calls it makes and nothing more.

A store implements the roles its mode serves. ``postgres`` (native mode) and ``memory`` (its
in-process twin, for fast tests) implement them all; ``triggerflow.airflow.store`` serves
every role but :class:`DeferralStore` from Airflow's tables (there tasks defer and are
cancelled through Airflow's API server). Who takes which role:

==========================  =====================================================  ==========
role                        calls                                                  taken by
==========================  =====================================================  ==========
:class:`LeaseStore`         register, renew, unregister                            ``lease``
:class:`PresenceStore`      announce_presence, presence_gone, writer_gone          presence watch
:class:`ClaimStore`         claim, release, release_lost, taken_since,             consumer, reconcile
                            fail_unloadable, other_loaders, forget,
                            sweep_cancelled
:class:`ProbationStore`     claim_probation, clear_probation, strike               probation, strikes
:class:`EventStore`         apply_events, apply_unlocked                           ``writer``
:class:`ReaperStore`        reap_dead, resend_unclaimed, time_out_orphans,         ``reaper``
                            waiting_queues, queue_consumers
:class:`DeferralStore`      defer, undo_defer, cancel                              ``sdk``
==========================  =====================================================  ==========

Composed: :class:`ConsumerStore` (what a consumer process uses), :class:`WriterStore` (a
writer process), :class:`ServingStore` (both, and ``close``: what a :class:`~triggerflow.
modes.Mode` connects), :class:`SdkStore` (deferrals and ``close``) and :class:`Store` (every
role: the native and in-memory stores).

Beyond the roles, what one mode's store can do and another's cannot is not found out by
probing the store: the mode says it (:class:`Capabilities`, ``Mode.capabilities``) and the
composition root hands that to the loops beside the store.

Contract shared by every implementation (``tests/contract`` runs it on each):

* **Fencing by attempt.** A claim raises a trigger's ``attempt``; an event applies only when
  its (trigger id, attempt, queue) is the current one and the task is still deferred on it.
* **Leases by clock.** A process's lease (its ``register`` row) lives ``ttl`` seconds from
  its last ``renew``; a trigger whose owner's lease expired may be claimed by anyone.
* **Idempotence.** Re-applying an event, re-claiming an owned id, releasing twice: no change.

Errors and values: :mod:`triggerflow.store.interface`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from triggerflow.store.interface import (
    MAX_BLOCKS,
    Applied,
    Cancelled,
    ClaimResult,
    NewDeferral,
    ProcessKind,
    Reaped,
    Renewal,
    Struck,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.wire import Event


class Closable(Protocol):
    async def close(self) -> None:
        """Release the store's connections (whoever connected it closes it)."""
        ...


class LeaseStore(Protocol):
    """A process's lease: the row that says it is alive, and what renewing it saw."""

    async def register(
        self,
        kind: ProcessKind,
        host: str,
        pid: int,
        queues: Sequence[str],
        capacity: int,
        version: str,
        ttl: float,
    ) -> int:
        """Start a lease of ``ttl`` seconds; returns this process's id."""
        ...

    async def renew(
        self,
        me: int,
        ttl: float,
        running: int,
        queues: Sequence[str],
        *,
        subscribed: bool = True,
        clock_skew: float | None = None,
        warming: bool = False,
    ) -> Renewal | None:
        """Extend my lease; None when it had already expired (I am fenced: stop everything).
        ``subscribed``: whether I am subscribed on the broker; only consumers that are count
        as live peers (capacity) for anyone's rebalancing and consumer counts.
        ``clock_skew``: my clock's last measured offset from the database's, kept on my row
        for ``status``. ``warming``: I am unsubscribed on purpose until my trigger runtime
        answers, kept on my row so ``status`` does not name me as refused by the broker."""
        ...

    async def unregister(self, me: int) -> None:
        """Leave; triggers still owned are freed and dated back so they are re-sent at once."""
        ...


class PresenceStore(Protocol):
    """The broker's word that a consumer's or a writer's connection closed ends its lease at
    once."""

    async def announce_presence(self, me: int, presence: str) -> bool:
        """Name the broker presence queue of my current connection (the one whose deletion
        says my connection closed); False when my row is gone."""
        ...

    async def presence_gone(self, presence: str, queues: Sequence[str]) -> list[int]:
        """The broker deleted ``presence``: end now the lease of the live consumer of one of
        ``queues`` whose current connection it named, as if it had expired (the same
        incarnation only: a consumer that reconnected named another); returns its id."""
        ...

    async def writer_gone(self, presence: str) -> list[int]:
        """The broker deleted ``presence``: end now the lease of the live writer whose current
        connection named it (that incarnation only); returns its id. A writer fences nothing:
        this is for ``status`` and ``health``, which would otherwise wait for its lease."""
        ...


class ClaimStore(Protocol):
    """A consumer's triggers: claim the delivered ones, hand them back, drop finished ones."""

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        """Take the delivered ids of my queues that no live owner holds."""
        ...

    async def release(
        self,
        me: int,
        ids: Sequence[int] | None = None,
        *,
        cannot_load: bool = False,
        reason: str | None = None,
    ) -> list[TriggerRef]:
        """Hand back my triggers (all when ``ids`` is None), no failure counted; with
        ``cannot_load`` remember that I refused them so the next claim passes them on."""
        ...

    async def release_lost(self, me: int, ids: Sequence[int], attempts: Sequence[int]) -> list[TriggerRef]:
        """Reconcile: free the rows among ``ids`` I still own at exactly ``attempts`` though I
        no longer run them (their event was lost), to be re-sent. Reads only these rows."""
        ...

    async def taken_since(self, me: int, seconds: float) -> list[tuple[int, int]]:
        """(id, attempt) of the triggers I own that a claim or take-over gave me within the
        last ``seconds`` (the store's clock): what a statement whose reply never came may
        have made mine."""
        ...

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        """Of the unowned triggers I refused, fail (``__fail__`` naming the class) those no
        other live consumer of their queue may still load; returns their ids."""
        ...

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        """Live consumers of the trigger's queue, other than me, that have not refused it."""
        ...

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        """Drop triggers I held and stopped because their task was cancelled."""
        ...

    async def sweep_cancelled(self, me: int) -> list[int]:
        """Drop triggers I hold whose task is no longer deferred on them; returns their ids."""
        ...


class ProbationStore(Protocol):
    """Suspects and quarantine: run suspects in halving groups, strike a loop-blocker."""

    async def claim_probation(
        self, me: int, queues: Sequence[str], limit: int | None = None
    ) -> list[TriggerSpec]:
        """Claim half of the worst suspects (at most ``limit``: my free capacity) and record
        them as my probation group."""
        ...

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        """The probation group survived: clear their failure counts."""
        ...

    async def strike(
        self, me: int, trigger_id: int, attempt: int, blocked: float, max_blocks: int,
        queues: Sequence[str],
    ) -> Struck | None:
        """The trigger blocked my event loop for ``blocked`` seconds in its run ``attempt``:
        count that run as one block against it, whoever holds it now (a peer may have taken
        it over while my loop was blocked), but only a trigger of my ``queues``. At
        ``max_blocks`` blocked runs it is quarantined (its task fails naming the class and
        the block, rounded to 0.1 s). A row still at ``attempt`` held by me or by nobody is
        freed to be re-sent at a raised attempt. None when nothing was recorded: that run was
        counted already (a retry after a lost answer, or a reaper that blamed it), or the
        trigger is gone, quarantined, or not of my queues."""
        ...


class EventStore(Protocol):
    """The writer's one job: apply fired events, fenced."""

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        """Apply a batch in one transaction, fenced by attempt and queue; stale, duplicate
        or unknown events change nothing. Raises :class:`EventRefused` on bad content,
        :class:`EventsLocked` when rows held elsewhere outlast the lock timeout."""
        ...

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        """As ``apply_events``, never waiting for a row lock: applies the events whose rows no
        other transaction holds and returns (applied, the events whose rows are held)."""
        ...


class ReaperStore(Protocol):
    """What nobody runs any more: dead owners' triggers, lost wake-ups, orphaned tasks
    (``queues`` None: every queue)."""

    async def reap_dead(
        self,
        queues: Sequence[str] | None,
        max_failures: int,
        limit: int | None = None,
        taker: Taker | None = None,
        max_blocks: int = MAX_BLOCKS,
    ) -> Reaped:
        """Free the triggers of expired owners, blaming and quarantining as probation says;
        but an owner that held a known loop-blocker (a trigger with a block counted) was
        stalled by it: only the blocker is blamed, its run counted as a block (quarantined at
        ``max_blocks``), and the innocents it stalled are freed (or taken) uncharged.
        at most ``limit`` a call where the store batches (fewer returned: none are left).
        With a ``taker`` (``queues`` given), what it may run becomes its own instead of
        free; a store may also take none and free them all."""
        ...

    async def resend_unclaimed(
        self, queues: Sequence[str] | None, grace: float, limit: int
    ) -> list[TriggerRef]:
        """Triggers nobody claimed within ``grace`` seconds, marked dispatched again."""
        ...

    async def time_out_orphans(self, queues: Sequence[str] | None, max_deferral: float) -> list[TriggerRef]:
        """Fail deferred tasks past their timeout whose trigger runs nowhere; their triggers
        (gone now), with their queues for the timed-out counter."""
        ...

    async def waiting_queues(self, grace: float) -> list[str]:
        """Queues with triggers unclaimed for longer than ``grace`` seconds."""
        ...

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        """Live consumers per queue."""
        ...


class DeferralStore(Protocol):
    """The SDK's side: record deferrals, undo one that could not be published, cancel."""

    async def defer(self, deferrals: Sequence[NewDeferral]) -> list[int]:
        """Record triggers and move their tasks to ``deferred`` in one transaction."""
        ...

    async def undo_defer(self, ids: Sequence[int], error: str) -> None:
        """A deferral that could not be published: drop its triggers and fail its tasks."""
        ...

    async def cancel(self, ids: Sequence[int], state: str) -> list[Cancelled]:
        """Move tasks deferred on ``ids`` to ``state``; unowned triggers go at once."""
        ...


class ConsumerStore(LeaseStore, PresenceStore, ClaimStore, ProbationStore, ReaperStore, Protocol):
    """What a consumer process uses (it reaps its queues' dead peers itself)."""


class WriterStore(LeaseStore, PresenceStore, EventStore, ReaperStore, Protocol):
    """What a writer process uses."""


class ServingStore(ConsumerStore, WriterStore, Closable, Protocol):
    """What a mode connects for its consumers and writers."""


class SdkStore(DeferralStore, Closable, Protocol):
    """What the SDK connects."""


class Store(ServingStore, DeferralStore, Protocol):
    """Every role: the native and in-memory stores."""


# Given ``wake``: an async context in which ``wake()`` is called soon after a task leaves its
# trigger (Airflow mode: LISTEN on its cancel log).
CancelSignal = Callable[[Callable[[], None]], AbstractAsyncContextManager[None]]


@dataclass(frozen=True)
class Capabilities:
    """What a mode's store does beyond the roles every store serves; the defaults are native
    mode's.

    ``cancel_signal``: the consumer's cancel sweep runs as soon as it fires, its interval
    staying the backstop for a signal lost while reconnecting; None, the sweep only polls.
    ``times_out_orphans``: ``ReaperStore.time_out_orphans`` fails tasks deferred past
    ``max_deferral`` whose trigger ran nowhere; False where someone else times deferrals out
    (Airflow's scheduler): the reapers skip that sweep.
    ``teams``: a consumer can be scoped to one Airflow team (``airflow_team``).
    """

    cancel_signal: CancelSignal | None = None
    times_out_orphans: bool = True
    teams: bool = False
