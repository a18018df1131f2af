"""The writer's per-queue lanes: what keeps one team from delaying another's events.

Events of different queues never share a statement, so a team's poison, junk or row locks
touch only its own batches; and the writer takes its turns round-robin between queues with
work, so a team with a thousand messages waiting gets one turn, then every other team gets
one. A batch the store refuses is split into halves that go back to the front of their lane
as separate turns (a split costs the other teams one statement each time, not the whole
search). Events whose rows another transaction holds wait in their lane's ``held`` list,
retried with a growing delay and without waiting for the lock, while their messages stay
unacked; past ``max_held`` messages a lane's oldest held work is handed back to be
dead-lettered, so held messages cannot fill the writer's prefetch and starve other queues.

Pure bookkeeping, no I/O: a message is acked once every work naming it is resolved.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from triggerflow.transport import Delivery
from triggerflow.wire import Event, WireError, decode_events

HELD_RETRY_FIRST = 0.1  # seconds before the first retry of held events; doubles per retry
HELD_RETRY_MAX = 2.0


@dataclass(eq=False)
class Letter:
    """A dead letter to file before the message(s) it came from are acked."""

    body: bytes
    reason: str
    source: str
    filed: bool = False  # shared by every message of a work: filed once


@dataclass(eq=False)
class Received:
    """One event message: its events, or why it is dead-lettered instead."""

    message: Delivery
    events: list[Event]
    reject: str | None = None
    forged: list[tuple[Event, str]] = field(default_factory=list)  # (event, why refused)
    open: int = 0  # works naming this message not yet resolved
    letters: list[Letter] = field(default_factory=list)  # of its events the store refused


@dataclass(eq=False)
class Work:
    """Events of one queue applied in one statement, and the messages they came in."""

    queue: str
    events: list[Event]
    messages: list[Received]
    held: bool = False  # rows held elsewhere: retried without waiting for the lock
    solo: bool = False  # a split half, a failure or a retry: never merged with others
    due: float = 0.0  # loop time before which a held work is not retried
    tries: int = 0
    held_since: float = 0.0


def decode(message: Delivery, max_bytes: int, team_users: Mapping[str, str]) -> Received:
    """A delivery's events (a body over ``max_bytes`` is refused unread), less the forged."""
    try:
        events = decode_events(message.body, max_bytes)
    except WireError as exc:
        return Received(message, [], reject=str(exc))
    kept: list[Event] = []
    forged: list[tuple[Event, str]] = []
    for ev in events:
        why = _forged(ev, message, team_users)
        if why is None:
            kept.append(ev)
        else:
            forged.append((ev, why))
    return Received(message, kept, forged=forged)


def _forged(ev: Event, message: Delivery, team_users: Mapping[str, str]) -> str | None:
    """Why ``ev`` may not be applied from this message, or None when it may.

    Topic permissions pin a team's user to its own routing keys, so the routing key names the
    publishing team's queue: an event for another queue's trigger is forged, whatever
    ``team_users`` says. Where ``team_users`` names the queue's user, RabbitMQ's validated
    ``user_id`` must match it as well. (So a lane holds one queue's events only.)
    """
    if ev.queue != message.routing_key:
        return (f"forged: routing key {message.routing_key!r} may not carry events of "
                f"{ev.queue!r}")
    owner = team_users.get(ev.queue)
    if owner is not None and owner != message.user_id:
        return f"forged: user {message.user_id!r} may not publish events of {ev.queue}"
    return None


def new_work(queue: str, events: list[Event], messages: list[Received], **flags: bool) -> Work:
    """A work over ``events`` that each of ``messages`` waits for."""
    unique = list({id(m): m for m in messages}.values())
    for m in unique:
        m.open += 1
    return Work(queue, events, unique, **flags)


def batch(events: list[Event]) -> list[Event]:
    """Each event once, sorted by trigger id: concurrent batches lock their rows in id order.
    A message delivered twice brings the same events twice; distinct events of one attempt
    (an asset watcher's or a callback's: a ``CallbackTrigger``'s "running" then "success")
    all stay, in the order they fired (the sort is stable). Keeping only the first of an
    attempt lost the callback's "success" whenever both came in one batch, and the callback
    stayed "running" for good. Done once per batch taken; split halves stay sorted."""
    seen: dict[tuple[int, int, str, float, str], Event] = {}
    for ev in events:
        seen.setdefault((ev.trigger_id, ev.attempt, ev.kind, ev.fired_at, ev.payload), ev)
    return sorted(seen.values(), key=lambda e: e.trigger_id)


def resolve(work: Work) -> list[Received]:
    """``work`` is done; the messages that no other work names any more."""
    done = []
    for m in work.messages:
        m.open -= 1
        if m.open == 0:
            done.append(m)
    return done


class Lanes:
    """Per-queue FIFOs of work, taken round-robin between queues."""

    def __init__(self, max_held: int, max_events: int) -> None:
        self.max_held = max_held  # held messages per lane before the oldest are given up
        self.max_events = max_events  # per work: a big message is several turns, not one
        self._pending: dict[str, deque[Work]] = {}
        self._held: dict[str, list[Work]] = {}
        self._turns: deque[str] = deque()
        self.contended: set[str] = set()  # queues whose rows were held: apply without waiting

    def _lane(self, queue: str) -> deque[Work]:
        if queue not in self._pending:
            self._pending[queue] = deque()
            self._held[queue] = []
            self._turns.append(queue)
        return self._pending[queue]

    def add(self, received: Received) -> None:
        """A decoded message's events (all of the queue its routing key names)."""
        queue, events = received.events[0].queue, received.events
        for i in range(0, len(events), self.max_events):
            self._lane(queue).append(new_work(queue, events[i:i + self.max_events], [received]))

    def push_front(self, work: Work) -> None:
        work.solo = True
        self._lane(work.queue).appendleft(work)

    def hold(self, work: Work, now: float) -> list[Work]:
        """Park ``work`` (its rows are held) until its retry is due; returns the works given
        up to keep the lane within ``max_held`` messages, oldest first."""
        if not work.held:
            work.held_since = now
        work.held = work.solo = True
        work.tries += 1
        work.due = now + min(HELD_RETRY_MAX, HELD_RETRY_FIRST * 2 ** (work.tries - 1))
        held = self._held.setdefault(work.queue, [])
        self._lane(work.queue)
        held.append(work)
        given_up: list[Work] = []
        while len(held) > 1 and len({id(m) for w in held for m in w.messages}) > self.max_held:
            given_up.append(held.pop(0))
        return given_up

    def held_events(self, queue: str) -> int:
        return sum(len(w.events) for w in self._held.get(queue, []))

    def take(self, now: float, max_events: int, free: int) -> Work | None:
        """The next queue's turn: its due held work, else the head of its lane merged with the
        works behind it up to ``max_events``, or its share of them when ``free`` slots could
        apply them side by side. None when no queue has work due."""
        for _ in range(len(self._turns)):
            if not self._turns:
                break
            queue = self._turns[0]
            self._turns.rotate(-1)
            work = self._take_from(queue, now, max_events, free)
            if work is not None:
                return work
            if not self._pending[queue] and not self._held[queue]:
                self._forget(queue)
        return None

    def _take_from(self, queue: str, now: float, max_events: int, free: int) -> Work | None:
        held = self._held[queue]
        for i, work in enumerate(held):
            if work.due <= now:
                return held.pop(i)
        pending = self._pending[queue]
        if not pending:
            return None
        head = pending.popleft()
        if head.solo:
            return head
        share = -(-(len(pending) + 1) // free)  # works: one batch of all would finish last
        merged = [head]
        size = len(head.events)
        while pending and not pending[0].solo and size < max_events and len(merged) < share:
            merged.append(pending.popleft())
            size += len(merged[-1].events)
        if len(merged) == 1:
            head.events = batch(head.events)
            return head
        work = new_work(queue, batch([ev for w in merged for ev in w.events]),
                        [m for w in merged for m in w.messages])
        for w in merged:
            resolve(w)  # the merged work names the same messages now
        return work

    def _forget(self, queue: str) -> None:
        del self._pending[queue], self._held[queue]
        self._turns.remove(queue)
        self.contended.discard(queue)

    def next_due(self) -> float | None:
        dues = [w.due for held in self._held.values() for w in held]
        return min(dues) if dues else None

    def has_pending(self) -> bool:
        return any(self._pending.values())

    def clear(self) -> None:
        """The channel died: every unacked delivery comes back; forget them all."""
        self._pending.clear()
        self._held.clear()
        self._turns.clear()
        self.contended.clear()
