"""The store's vocabulary: the errors it raises and the values its calls take and return.

The calls themselves are the role protocols of :mod:`triggerflow.store.roles` (a lease, a
consumer's claims, the writer's events, the reaper, the SDK's deferrals), each with the
contract every implementation keeps. How stored kwargs are decoded differs between stores
and is hidden here: a claimed trigger arrives as a :class:`TriggerSpec` the loop can load,
or with a per-row :class:`KwargsError`.

Errors: :class:`StoreUnavailable` when the store cannot be reached right now (worth a retry),
:class:`StoreAccessRefused` when it refuses our credentials, :class:`EventRefused` when
``apply_events`` refuses the batch's content (split it and find the bad event),
:class:`StoreError` for anything else the store refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from triggerflow.errors import TriggerflowError

# What every store applies alike (memory in Python; the SQL stores have them written into
# their statements' text, as literals, so the plans stay what they were).
SUSPECT_FAILURES = 2  # ungraceful losses that make a trigger a suspect (run on probation)
ORPHAN_SLACK = 2  # seconds past its timeout before a deferred task is failed as orphaned
# Runs in which a trigger blocked its consumer's event loop before it is quarantined (the
# default of ``max_blocks``): each such run stalls every trigger on that consumer, and past
# the lease hands them all to a peer, so the count is low (docs/security.md, "Loop blockers").
MAX_BLOCKS = 3


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
    said it cannot load: pass them on to another consumer of their queue. ``elsewhere``
    (Airflow's teams) are rows of another team that a live consumer of theirs serves on the
    same queue: the broker shares a queue's wake-ups among all its consumers, so hand them on.
    """

    claimed: list[TriggerSpec] = field(default_factory=list)
    suspects: list[int] = field(default_factory=list)
    refused: list[TriggerRef] = field(default_factory=list)
    elsewhere: list[TriggerRef] = field(default_factory=list)


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
class Struck:
    """A strike recorded against a loop-blocker: ``blocks`` runs of it blocked a loop so far;
    ``freed``: the strike freed the row (the blocked run still held it), to re-send;
    ``quarantined``: its task failed, never re-sent. Neither: another consumer runs it now."""

    id: int
    queue: str
    classpath: str
    blocks: int
    quarantined: bool
    freed: bool


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
