"""The store: what the loops need from the durable record, named by what it does.

The consumer, writer, reaper and SDK depend on this Protocol only. ``postgres`` implements
it for triggerflow's own tables (native mode); ``memory`` mirrors it in-process for fast
tests; an Airflow-mode store serves the same calls from Airflow's tables. Everything that
differs between modes lives behind it: how stored kwargs are decoded (a claimed trigger
arrives as a :class:`TriggerSpec` the loop can load, or with a per-row :class:`KwargsError`),
how an event moves its task, and what a "queue" is.

Contract shared by every implementation:

* **Fencing by attempt.** A claim raises a trigger's ``attempt``; an event applies only when
  its (trigger id, attempt, queue) is the current one and the task is still deferred on it.
* **Leases by clock.** A process's lease (its ``register`` row) lives ``ttl`` seconds from
  its last ``renew``; a trigger whose owner's lease expired may be claimed by anyone.
* **Idempotence.** Re-applying an event, re-claiming an owned id, releasing twice: no change.

Errors: :class:`StoreUnavailable` when the store cannot be reached right now (worth a retry),
:class:`StoreAccessRefused` when it refuses our credentials, :class:`EventRefused` when
``apply_events`` refuses the batch's content (split it and find the bad event),
:class:`StoreError` for anything else the store refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from triggerflow.errors import TriggerflowError
from triggerflow.wire import Event


class StoreError(TriggerflowError):
    """The store refused or failed a call."""


class StoreUnavailable(StoreError):
    """The store is unreachable right now (restart, dropped connection): retry later."""


class StoreAccessRefused(StoreError):
    """The database refused our credentials (password, role, database name): retrying the
    same configuration is useful only while a secret is being rotated."""


class EventRefused(StoreError):
    """``apply_events`` refused the content of at least one event of the batch."""


class EventsLocked(StoreError):
    """``apply_events`` gave up waiting (the writer's ``lock_timeout``) for rows another
    transaction holds, such as a team's own ``SELECT ... FOR UPDATE`` on its tasks. Nothing
    was applied: ``apply_unlocked`` applies what is free and names the rest."""


class ProcessKind(StrEnum):
    CONSUMER = "consumer"
    WRITER = "writer"


class KwargsProblem(StrEnum):
    """Why stored kwargs could not be decoded for a claimed trigger."""

    UNREADABLE_HERE = "unreadable_here"  # e.g. encrypted and this process has no key
    INVALID = "invalid"  # no process can decode them


@dataclass(frozen=True, slots=True)
class KwargsError:
    problem: KwargsProblem
    message: str


@dataclass(frozen=True, slots=True)
class TriggerSpec:
    """A claimed trigger, ready to load: class path and decoded kwargs (or why not)."""

    id: int
    attempt: int
    queue: str
    classpath: str
    kwargs: dict[str, Any] | None
    kwargs_error: KwargsError | None = None
    task: str | None = None  # "dag.task@run", for logs
    timeout_at: float | None = None  # epoch seconds
    traceparent: str | None = None
    # Airflow mode: epoch seconds before which an event that reschedules the task is held
    # (the deferral is too recent for Airflow's scheduler; see airflow/loader.py).
    not_before: float | None = None


@dataclass(frozen=True, slots=True)
class TriggerRef:
    """A trigger and the queue its wake-up goes to."""

    id: int
    queue: str


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """What one claim found among the delivered ids.

    ``claimed`` now run here (attempt raised, owner = me). ``suspects`` were lost
    ungracefully before and wait to run on probation. ``refused`` are triggers this process
    said it cannot load: pass them on to another consumer of their queue.
    """

    claimed: list[TriggerSpec] = field(default_factory=list)
    suspects: list[int] = field(default_factory=list)
    refused: list[TriggerRef] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Renewal:
    """A renewed lease, and what the renewal saw of the peers serving the same queues."""

    dead_peers: int
    live_peers: int
    peers_running: int
    db_time: float  # the database's clock as it renewed (epoch seconds): the skew check's


@dataclass(frozen=True, slots=True)
class FreedTrigger:
    """A trigger freed from a dead owner; ``quarantined`` ones are not re-sent."""

    id: int
    queue: str
    classpath: str
    failures: int
    quarantined: bool


@dataclass(frozen=True, slots=True)
class Taker:
    """A reaping consumer that takes dead peers' triggers over in the reaping rewrite: at
    most ``room``, of the reaper's queues, not suspects, not refused by ``me`` before."""

    me: int
    room: int


@dataclass(frozen=True, slots=True)
class Reaped:
    """``freed``: now unowned, to re-send (unless quarantined); ``taken``: owned by the
    taker now, at a raised attempt, to start. ``dead_owners``: consumer rows gone."""

    freed: list[FreedTrigger]
    dead_owners: int
    taken: list[TriggerSpec] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class NewDeferral:
    """One deferral as the SDK validated it: kwargs already encoded for storage."""

    dag_id: str
    task_id: str
    run_id: str
    map_index: int
    classpath: str
    stored_kwargs: str
    queue: str
    next_method: str
    next_kwargs: str  # JSON text
    timeout: float  # seconds
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A cancelled trigger: ``owner`` still runs it (send it a control message, on the
    control exchange of ``queue``), ``moved`` when its task left ``deferred`` because of
    this call."""

    id: int
    owner: int | None
    moved: bool
    queue: str = ""


@dataclass(frozen=True, slots=True)
class Applied:
    """An event that moved its task. ``latency`` is seconds from fire to commit."""

    kind: str
    queue: str
    latency: float


class Store(Protocol):
    """The durable record the loops run on. See the module docstring for the contract."""

    async def close(self) -> None: ...

    # -- a process's lease ----------------------------------------------------------------

    async def register(self, kind: ProcessKind, host: str, pid: int, queues: Sequence[str],
                       capacity: int, version: str, ttl: float) -> int:
        """Start a lease of ``ttl`` seconds; returns this process's id."""
        ...

    async def renew(self, me: int, ttl: float, running: int, queues: Sequence[str], *,
                    subscribed: bool = True, clock_skew: float | None = None) -> Renewal | None:
        """Extend my lease; None when it had already expired (I am fenced: stop everything).
        ``subscribed``: whether I am subscribed on the broker; only consumers that are count
        as live peers (capacity) for anyone's rebalancing and consumer counts.
        ``clock_skew``: my clock's last measured offset from the database's, kept on my row
        for ``status``."""
        ...

    async def unregister(self, me: int) -> None:
        """Leave; triggers still owned are freed and dated back so they are re-sent at once."""
        ...

    async def announce_presence(self, me: int, presence: str) -> bool:
        """Name the broker presence queue of my current connection (the one whose deletion
        says my connection closed); False when my row is gone."""
        ...

    async def presence_gone(self, presence: str, queues: Sequence[str]) -> list[int]:
        """The broker deleted ``presence``: end now the lease of the live consumer of one of
        ``queues`` whose current connection it named, as if it had expired (the same
        incarnation only: a consumer that reconnected named another); returns its id."""
        ...

    # -- consumer ------------------------------------------------------------------------

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        """Take the delivered ids of my queues that no live owner holds."""
        ...

    async def claim_probation(self, me: int, queues: Sequence[str],
                              limit: int | None = None) -> list[TriggerSpec]:
        """Claim half of the worst suspects (at most ``limit``: my free capacity) and record
        them as my probation group."""
        ...

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        """The probation group survived: clear their failure counts."""
        ...

    async def release(self, me: int, ids: Sequence[int] | None = None, *,
                      cannot_load: bool = False, reason: str | None = None) -> list[TriggerRef]:
        """Hand back my triggers (all when ``ids`` is None), no failure counted; with
        ``cannot_load`` remember that I refused them so the next claim passes them on."""
        ...

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        """Reconcile: free the rows among ``ids`` I still own at exactly ``attempts`` though I
        no longer run them (their event was lost), to be re-sent. Reads only these rows."""
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

    async def strike(self, me: int, trigger_id: int, attempt: int, blocked: float,
                     max_failures: int) -> FreedTrigger | None:
        """The trigger blocked my event loop for ``blocked`` seconds at ``attempt``: count one
        failure against it and free it to be re-sent, or at ``max_failures`` quarantine it
        as ``reap_dead`` does (its task fails naming the class and the block, rounded to
        0.1 s). Only while the row is still at ``attempt``, held by me or by nobody (my lease
        may have expired meanwhile); None when it is not (taken since, struck, or gone). The
        strike raises the attempt: recorded twice it counts once."""
        ...

    # -- writer --------------------------------------------------------------------------

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        """Apply a batch in one transaction, fenced by attempt and queue; stale, duplicate
        or unknown events change nothing. Raises :class:`EventRefused` on bad content,
        :class:`EventsLocked` when rows held elsewhere outlast the lock timeout."""
        ...

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        """As ``apply_events``, never waiting for a row lock: applies the events whose rows no
        other transaction holds and returns (applied, the events whose rows are held)."""
        ...

    # -- reaper (``queues`` None: every queue) --------------------------------------------

    async def reap_dead(self, queues: Sequence[str] | None, max_failures: int,
                        limit: int | None = None, taker: Taker | None = None) -> Reaped:
        """Free the triggers of expired owners, blaming and quarantining as probation says;
        at most ``limit`` a call where the store batches (fewer returned: none are left).
        With a ``taker`` (``queues`` given), what it may run becomes its own instead of
        free; a store may also take none and free them all."""
        ...

    async def resend_unclaimed(self, queues: Sequence[str] | None, grace: float,
                               limit: int) -> list[TriggerRef]:
        """Triggers nobody claimed within ``grace`` seconds, marked dispatched again."""
        ...

    async def time_out_orphans(self, queues: Sequence[str] | None,
                               max_deferral: float) -> list[TriggerRef]:
        """Fail deferred tasks past their timeout whose trigger runs nowhere; their triggers
        (gone now), with their queues for the timed-out counter."""
        ...

    async def waiting_queues(self, grace: float) -> list[str]:
        """Queues with triggers unclaimed for longer than ``grace`` seconds."""
        ...

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        """Live consumers per queue."""
        ...

    # -- SDK -----------------------------------------------------------------------------

    async def defer(self, deferrals: Sequence[NewDeferral]) -> list[int]:
        """Record triggers and move their tasks to ``deferred`` in one transaction."""
        ...

    async def undo_defer(self, ids: Sequence[int], error: str) -> None:
        """A deferral that could not be published: drop its triggers and fail its tasks."""
        ...

    async def cancel(self, ids: Sequence[int], state: str) -> list[Cancelled]:
        """Move tasks deferred on ``ids`` to ``state``; unowned triggers go at once."""
        ...
