"""Property tests of the wire format (``wire``) and the kwargs codec (``codec``): every
message type survives a round trip, and bytes from anywhere (the broker carries what any
publisher sent) either decode to a message the rest of the system can use or raise
``WireError``, the one error the consumer and the writer dead-letter on; nothing else.

Derandomized with a fixed budget, like the model-based test (``TRIGGERFLOW_TEST_MODEL_SEED``
draws other examples, docs/testing.md)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from cryptography.fernet import Fernet, InvalidToken
from hypothesis import given, seed, settings

from triggerflow.codec import ENCRYPTED_PREFIX, KwargsCodec
from triggerflow.wire import (
    EVENT_KINDS,
    MAX_IDS,
    SCHEMA_VERSION,
    Control,
    Event,
    WireError,
    decode_control,
    decode_events,
    decode_json,
    decode_wakeup,
    encode_control,
    encode_events,
    encode_json,
    encode_wakeup,
)

BIGINT = 2**63 - 1  # what a store's trigger id column holds
SEED = os.environ.get("TRIGGERFLOW_TEST_MODEL_SEED")


def budget(test: Callable[..., None]) -> Callable[..., None]:
    configured = settings(max_examples=300, deadline=None, database=None,
                          derandomize=SEED is None, print_blob=False)(test)
    return seed(int(SEED))(configured) if SEED else configured


trigger_ids = st.integers(min_value=0, max_value=BIGINT)
attempts = st.integers(min_value=-(2**31), max_value=2**31 - 1)
text = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)  # what UTF-8 can carry
finite = st.floats(allow_nan=False, allow_infinity=False)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | finite | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12)
events = st.builds(Event, trigger_ids, attempts, text, st.sampled_from(sorted(EVENT_KINDS)),
                   json_values.map(encode_json), finite, st.none() | text)


@budget
@given(st.lists(trigger_ids, min_size=1, max_size=20))
def test_a_wakeup_round_trips(ids: list[int]) -> None:
    assert decode_wakeup(encode_wakeup(ids)) == ids


@budget
@given(st.lists(events, max_size=5))
def test_an_event_batch_round_trips(batch: list[Event]) -> None:
    assert decode_events(encode_events(batch)) == batch


@budget
@given(text, st.lists(trigger_ids, max_size=20))
def test_a_control_message_round_trips(op: str, ids: list[int]) -> None:
    assert decode_control(encode_control(op, ids)) == Control(SCHEMA_VERSION, op, ids)


@budget
@given(st.dictionaries(text, json_values, max_size=5), st.booleans())
def test_kwargs_round_trip_plain_and_encrypted(kwargs: dict[str, Any], keyed: bool) -> None:
    codec = KwargsCodec(Fernet.generate_key().decode() if keyed else None)
    stored = codec.encode(kwargs, "team-a")
    assert stored.startswith(ENCRYPTED_PREFIX) == keyed
    assert codec.decode(stored, "team-a") == kwargs
    assert decode_json(encode_json(kwargs)) == kwargs


# Bytes from anywhere: raw bytes, and JSON shaped like our messages, so the decoders' later
# checks (versions, kinds, bounds) are reached, not only the parser's. Numbers include the
# edges of the id columns (Airflow's int, the native bigint) and past them.
numbers = st.sampled_from([-1, 0, 2**31 - 1, 2**31, BIGINT, BIGINT + 1, 2**64, 10**30]) \
    | st.integers()
shaped = st.fixed_dictionaries({}, optional={
    "v": st.sampled_from([0, 1, 2, 3]) | json_values,
    "ids": st.lists(numbers | json_values, max_size=4) | json_values,
    "id": numbers | json_values,
    "op": json_values,
    "events": st.lists(st.lists(json_values | st.sampled_from(sorted(EVENT_KINDS)),
                                max_size=7), max_size=3) | json_values,
}).map(lambda d: json.dumps(d).encode())
near_wakeups = st.fixed_dictionaries(
    {"v": st.sampled_from([1, 2]), "ids": st.lists(numbers, max_size=4)},
    optional={"id": numbers}).map(lambda d: json.dumps(d).encode())
anything = (st.binary(max_size=200) | shaped | near_wakeups
            | st.lists(events, max_size=3).map(encode_events))


def only_wire_errors(decode: Callable[[bytes], Any], body: bytes) -> Any:
    try:
        return decode(body)
    except WireError:
        return None


@budget
@given(anything)
def test_any_bytes_make_a_usable_wakeup_or_a_wire_error(body: bytes) -> None:
    ids = only_wire_errors(decode_wakeup, body)
    if ids is not None:  # ids a store can be asked about: a claim of them never fails
        assert 1 <= len(ids) <= MAX_IDS
        assert all(type(i) is int and 0 <= i <= BIGINT for i in ids)


@budget
@given(anything)
def test_any_bytes_make_valid_events_or_a_wire_error(body: bytes) -> None:
    batch = only_wire_errors(decode_events, body)
    if batch is not None:
        assert all(isinstance(ev, Event) and ev.kind in EVENT_KINDS for ev in batch)


@budget
@given(anything)
def test_any_bytes_make_a_control_message_or_a_wire_error(body: bytes) -> None:
    ctl = only_wire_errors(decode_control, body)
    if ctl is not None:
        assert isinstance(ctl, Control) and all(type(i) is int for i in ctl.ids)


@budget
@given(st.text(max_size=80) | st.builds(lambda t: ENCRYPTED_PREFIX + t, st.text(max_size=80)))
def test_any_stored_kwargs_decode_to_an_object_or_a_value_error(stored: str) -> None:
    """What the stores turn into a per-trigger ``KwargsError`` (never a failed claim)."""
    codec = KwargsCodec(Fernet.generate_key().decode())
    with contextlib.suppress(ValueError, InvalidToken):
        assert isinstance(codec.decode(stored, "team-a"), dict)
