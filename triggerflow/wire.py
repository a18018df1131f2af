"""Bytes <-> messages. msgspec structs; imports nothing else of ours.

Wake-ups carry trigger ids only: classpath and kwargs are read from PostgreSQL, never from
the broker. Events carry (trigger id, attempt) so the writer can fence stale attempts.
A reader accepts the current schema version and the one before it (rolling upgrades).
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Annotated, Any, Protocol, TypeVar

import msgspec

from triggerflow.errors import TriggerflowError

SCHEMA_VERSION = 2
ACCEPTED_VERSIONS = frozenset({SCHEMA_VERSION, SCHEMA_VERSION - 1})

HEADER_TRACEPARENT = "traceparent"
HEADER_REASON = "x-triggerflow-reason"
HEADER_TRUNCATED = "x-triggerflow-truncated"  # a dead letter's original size, when cut
CONTENT_TYPE = "application/json"

# Size bounds at the edge. The broker refuses bigger messages of anyone
# (``max_message_size`` in brokers/rabbitmq/rabbitmq.conf is MAX_MESSAGE_BYTES); readers check
# again before decoding, so a broker configured otherwise still cannot make a consumer decode
# 41 MB of ids. Wake-ups and control messages carry at most MAX_IDS ids (about 20 bytes each).
MAX_MESSAGE_BYTES = 4 << 20
MAX_IDS = 10_000
MAX_ID_MESSAGE_BYTES = 256 << 10


class WireError(TriggerflowError, ValueError):
    """A message that cannot be decoded; the caller dead-letters it with this reason."""


# A trigger id as the stores hold it (bigint). Bounded at decoding: one id past it in a
# wake-up made the consumer's claim of its whole batch fail, requeued with the batch, again
# and again (the legitimate wake-ups beside it never claimed).
TriggerId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class Wakeup(msgspec.Struct, forbid_unknown_fields=False):
    """Deferral wake-up: "these triggers of your queue want running". v1 had one ``id``."""

    v: int
    ids: list[TriggerId] = []
    id: TriggerId | None = None


# The values of ``model.EventKind``, spelled here so that an event of any other kind fails to
# decode (wire imports nothing of ours; a unit test keeps the two equal).
EVENT_KINDS = frozenset({"resume", "success", "failed", "skipped", "fail"})


class Event(msgspec.Struct, array_like=True):
    """One fired trigger. ``payload`` is JSON text, validated by the consumer; ``kind`` is
    one of :data:`EVENT_KINDS`, checked by :func:`decode_events`."""

    trigger_id: int
    attempt: int
    queue: str
    kind: str
    payload: str
    fired_at: float
    traceparent: str | None = None  # the fire span, so the writer's span joins the trace


class Stamped(Protocol):
    """What fences an event: the trigger and the attempt it fired in."""

    @property
    def trigger_id(self) -> int: ...

    @property
    def attempt(self) -> int: ...


StampedT = TypeVar("StampedT", bound=Stamped)


def first_per_attempt(events: Iterable[StampedT]) -> list[StampedT]:
    """The first event of each (trigger, attempt), in the order given. A task's trigger ends
    its deferral with its first event, so the set-based statements that move tasks apply one
    per attempt; the later events of an attempt are an asset watcher's or a callback's
    (``airflow/watchers.py``), applied one by one in order."""
    seen: dict[tuple[int, int], StampedT] = {}
    for ev in events:
        seen.setdefault((ev.trigger_id, ev.attempt), ev)
    return list(seen.values())


class EventBatch(msgspec.Struct):
    v: int
    events: list[Event]


class Control(msgspec.Struct):
    """Owner-addressed control message (``op`` = "cancel")."""

    v: int
    op: str
    ids: list[int]


_encoder = msgspec.json.Encoder()
_wakeup_decoder = msgspec.json.Decoder(Wakeup)
_batch_decoder = msgspec.json.Decoder(EventBatch)
_control_decoder = msgspec.json.Decoder(Control)

_Versioned = TypeVar("_Versioned", Wakeup, EventBatch, Control)


def _decode(decoder: msgspec.json.Decoder[_Versioned], body: bytes, what: str,
            max_bytes: int) -> _Versioned:
    """Decode and check the schema version; any failure is a WireError naming ``what``.
    A body over ``max_bytes`` is refused before any of it is decoded."""
    if len(body) > max_bytes:
        raise WireError(f"oversized {what}: {len(body)} bytes, over the {max_bytes}-byte bound")
    try:
        msg = decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"undecodable {what}: {exc}") from None
    if msg.v not in ACCEPTED_VERSIONS:
        raise WireError(
            f"unsupported schema version {msg.v}; accepted {sorted(ACCEPTED_VERSIONS)}")
    return msg


def encode_wakeup(ids: list[int]) -> bytes:
    return _encoder.encode(Wakeup(v=SCHEMA_VERSION, ids=ids))


def decode_wakeup(body: bytes) -> list[int]:
    msg = _decode(_wakeup_decoder, body, "wake-up", MAX_ID_MESSAGE_BYTES)
    ids = list(msg.ids)
    if msg.id is not None:
        ids.append(msg.id)
    if not ids:
        raise WireError("wake-up names no trigger")
    if len(ids) > MAX_IDS:
        raise WireError(f"oversized wake-up: {len(ids)} ids, over the {MAX_IDS}-id bound")
    return ids


def encode_events(events: list[Event]) -> bytes:
    return _encoder.encode(EventBatch(v=SCHEMA_VERSION, events=events))


# What one event adds to a message besides its strings (ids, kind, times, punctuation).
EVENT_OVERHEAD = 128


def event_size_bound(ev: Event) -> int:
    """Bytes ``ev`` can take in a message at most: a payload character takes up to 4 (UTF-8),
    and ``"`` or ``\\`` become two once escaped inside the event."""
    return EVENT_OVERHEAD + 4 * len(ev.payload) + len(ev.queue) + len(ev.traceparent or "")


_payload, _queue, _traceparent = (attrgetter(a) for a in ("payload", "queue", "traceparent"))


def split_by_size(events: list[Event], max_bytes: int) -> list[list[Event]]:
    """``events`` in order, cut into parts whose messages stay within ``max_bytes`` (what a
    writer parses), so a conforming publisher is never refused for size."""
    # Mostly one part (a burst's messages are event_batch small events): the bound of them
    # all, summed without a Python call per event, decides that at once.
    whole = (EVENT_OVERHEAD * len(events) + 4 * sum(map(len, map(_payload, events)))
             + sum(map(len, map(_queue, events)))
             + sum(map(len, filter(None, map(_traceparent, events)))))
    if whole <= max_bytes:
        return [events]
    parts: list[list[Event]] = [[]]
    size = 0
    for ev in events:
        n = event_size_bound(ev)
        if parts[-1] and size + n > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append(ev)
        size += n
    return parts


def decode_events(body: bytes, max_bytes: int | None = None) -> list[Event]:
    """The events of one message; any failure is a :class:`WireError`. A body over
    ``max_bytes`` is refused before it is parsed: a team's flood costs a length check."""
    if max_bytes is not None and len(body) > max_bytes:
        raise WireError(f"event message of {len(body)} bytes, over the {max_bytes}-byte cap; "
                        f"not parsed")
    events = _decode(_batch_decoder, body, "event batch", MAX_MESSAGE_BYTES).events
    # One set per batch, not a __post_init__ per event: that Python call ran for every event
    # a consumer built and a writer decoded.
    kinds = {ev.kind for ev in events}
    if not kinds <= EVENT_KINDS:
        unknown = min(kinds - EVENT_KINDS)
        at = next(i for i, ev in enumerate(events) if ev.kind == unknown)
        raise WireError(f"undecodable event batch: unknown event kind {unknown!r} "
                        f"- at `$.events[{at}]`")
    return events


def encode_control(op: str, ids: list[int]) -> bytes:
    return _encoder.encode(Control(v=SCHEMA_VERSION, op=op, ids=ids))


def decode_control(body: bytes) -> Control:
    return _decode(_control_decoder, body, "control message", MAX_ID_MESSAGE_BYTES)


def encode_json(value: Any) -> str:
    """JSON text for payloads and kwargs (datetimes become ISO-8601 strings)."""
    return _encoder.encode(value).decode()


def decode_json(text: str | bytes) -> Any:
    return msgspec.json.decode(text)


class PayloadError(TriggerflowError, ValueError):
    """An event payload the database would refuse; the event becomes a readable failure."""


def validate_payload(value: Any, max_bytes: int) -> str:
    """Encode an event payload, refusing what jsonb or the size cap would reject."""
    try:
        text = encode_json(value)
    except UnicodeEncodeError as exc:
        # A str holding undecodable bytes (os.fsdecode of a non-UTF-8 file name keeps them as
        # lone surrogates): no JSON text can carry it.
        raise PayloadError(
            f"event payload holds text that is not valid UTF-8 (a non-UTF-8 file name?): "
            f"{exc.reason} at position {exc.start} of {exc.object[max(0, exc.start - 20):exc.end + 20]!r}"
        ) from None
    except (TypeError, msgspec.EncodeError, OverflowError) as exc:
        raise PayloadError(f"event payload is not JSON-serializable: {exc}") from None
    if len(text) > max_bytes:
        raise PayloadError(f"event payload is {len(text)} bytes, over the {max_bytes} cap")
    if "\\u0000" in text:
        raise PayloadError("event payload contains a NUL character, which jsonb cannot store")
    return text
