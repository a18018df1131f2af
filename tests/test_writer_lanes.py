"""The writer's lanes as bookkeeping, without services: turns alternate between queues, a
split half goes before its queue's later messages, held work waits for its retry, a lane
keeps at most ``max_held`` messages held, and a message is done once every work naming it is."""

from __future__ import annotations

from typing import Any, cast

from triggerflow.transport import Delivery
from triggerflow.wire import Event, encode_events
from triggerflow.writer_lanes import Lanes, Received, decode, new_work, resolve


def message(queue: str, *ids: int) -> Received:
    return Received(cast(Delivery, object()), [Event(i, 0, queue, "resume", "1", 0.0) for i in ids])


def ids(work: Any) -> list[int]:
    return [ev.trigger_id for ev in work.events]


def test_turns_alternate_between_queues_whatever_one_of_them_has_waiting() -> None:
    lanes = Lanes(max_held=10, max_events=100)
    for i in range(5):
        lanes.add(message("a", i))
    lanes.add(message("b", 100))
    # One free slot: A's turn takes its share (all five), then B's turn comes.
    first = lanes.take(0.0, max_events=2, free=1)
    second = lanes.take(0.0, max_events=2, free=1)
    assert first is not None and second is not None
    assert (first.queue, ids(first)) == ("a", [0, 1])  # max_events bounds a turn
    assert (second.queue, ids(second)) == ("b", [100])
    third = lanes.take(0.0, max_events=10, free=1)
    assert third is not None and ids(third) == [2, 3, 4]
    assert lanes.take(0.0, max_events=10, free=1) is None


def test_a_split_half_is_its_own_turn_and_comes_before_its_queues_later_messages() -> None:
    lanes = Lanes(max_held=10, max_events=100)
    lanes.add(message("a", 1, 2, 3, 4))
    lanes.add(message("a", 9))
    lanes.add(message("b", 100))
    work = lanes.take(0.0, max_events=1, free=1)
    assert work is not None and ids(work) == [1, 2, 3, 4]
    for half in (work.events[2:], work.events[:2]):
        lanes.push_front(new_work("a", half, work.messages))
    assert resolve(work) == []  # the halves still name the message
    order = [lanes.take(0.0, max_events=10, free=1) for _ in range(4)]
    assert [(w.queue, ids(w)) for w in order if w] == [
        ("b", [100]), ("a", [1, 2]), ("a", [3, 4]), ("a", [9])]


def test_held_work_waits_for_its_retry_and_a_lane_holds_at_most_max_held_messages() -> None:
    lanes = Lanes(max_held=2, max_events=100)
    works = []
    for i in range(3):
        lanes.add(message("a", i))
        w = lanes.take(0.0, max_events=1, free=1)
        assert w is not None
        works.append(w)
    assert lanes.hold(works[0], now=10.0) == []
    assert lanes.hold(works[1], now=10.0) == []
    assert lanes.hold(works[2], now=10.0) == [works[0]]  # the oldest is given up
    assert lanes.take(10.0, max_events=10, free=1) is None  # not due yet
    due = lanes.next_due()
    assert due is not None and due > 10.0
    retry = lanes.take(due, max_events=10, free=1)
    assert retry is works[1] and retry.held


def test_a_message_is_done_when_the_last_work_naming_it_is_resolved() -> None:
    m = message("a", 1, 2)
    other = message("a", 3)
    lanes = Lanes(max_held=10, max_events=100)
    lanes.add(m)
    lanes.add(other)
    merged = lanes.take(0.0, max_events=10, free=1)
    assert merged is not None and ids(merged) == [1, 2, 3]
    half = new_work("a", merged.events[:1], merged.messages)
    assert resolve(merged) == []
    assert resolve(half) == [m, other]


def test_a_big_message_is_several_turns_of_at_most_max_events() -> None:
    lanes = Lanes(max_held=10, max_events=3)
    big = message("a", *range(7))
    lanes.add(big)
    lanes.add(message("b", 100))
    turns = [lanes.take(0.0, max_events=3, free=1) for _ in range(4)]
    assert [(w.queue, ids(w)) for w in turns if w] == [
        ("a", [0, 1, 2]), ("b", [100]), ("a", [3, 4, 5]), ("a", [6])]
    assert [resolve(w) for w in turns if w and w.queue == "a"] == [[], [], [big]]


class Delivered:
    def __init__(self, body: bytes) -> None:
        self.body, self.routing_key, self.user_id = body, "a", None


def test_a_message_over_the_cap_is_refused_unread_and_junk_is_refused_with_its_reason() -> None:
    body = encode_events([Event(1, 1, "a", "resume", "1", 0.0)])
    fits = decode(cast(Delivery, Delivered(body)), len(body), {})
    assert (fits.events[0].trigger_id, fits.reject) == (1, None)
    big = Delivered(body)
    over = decode(cast(Delivery, big), len(body) - 1, {})
    assert (over.message, over.events) == (big, [])
    assert over.reject == f"event message of {len(body)} bytes, over the {len(body) - 1}-byte cap; not parsed"
    junk = decode(cast(Delivery, Delivered(b"junk")), 100, {})
    assert junk.events == [] and (junk.reject or "").startswith("undecodable event batch: ")


def test_a_batch_keeps_each_event_of_an_attempt_once_in_the_order_they_fired() -> None:
    """A ``CallbackTrigger``'s "running" and "success" (one attempt) taken in one batch both
    stay, in order: keeping one per attempt left CI's deadline callback "running" for good.
    A message delivered twice still counts once."""
    running = Event(7, 1, "default", "resume", '{"state": "running"}', 1.0)
    success = Event(7, 1, "default", "resume", '{"state": "success"}', 1.1)
    other = Event(3, 2, "default", "resume", "1", 1.0)
    lanes = Lanes(max_held=10, max_events=100)
    first = Received(cast(Delivery, object()), [running, success, other])
    again = Received(cast(Delivery, object()), [running, success, other])  # redelivered
    lanes.add(first)
    lanes.add(again)
    work = lanes.take(0.0, max_events=100, free=1)
    assert work is not None
    assert work.events == [other, running, success]
