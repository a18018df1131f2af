"""``triggerflow status`` looks twice before naming a consumer "not subscribed": it reads a
queue the broker counts short of consumers again (``status_report.most_consumers``) and
asks the management API's subscription list again (``subscribed_in_either``). A consumer
renewing its subscriptions is absent from the count for a few milliseconds and from the list
until the next statistics sample; CI caught ``status`` exiting 3 on a healthy consumer in
that gap (tests/test_ops.py, tests/test_status_writer.py)."""

from __future__ import annotations

from triggerflow.cli.status_report import most_consumers, not_subscribed, subscribed_in_either
from triggerflow.transport import QueueInfo

CONSUMER = {"id": 7, "alive": True, "kind": "consumer", "running": 2, "capacity": 100,
            "started_ago": 60.0, "queues": ["team-a"], "host": "h", "pid": 1}


def test_a_consumer_seen_in_either_read_is_subscribed() -> None:
    first = {"team-a": QueueInfo(0, 0), "team-b": QueueInfo(3, 1), "gone": None}
    second = {"team-a": QueueInfo(1, 1), "team-b": QueueInfo(3, 0), "gone": QueueInfo(0, 2)}
    assert most_consumers(first, second) == {
        "team-a": QueueInfo(0, 1), "team-b": QueueInfo(3, 1), "gone": None}
    # the renewal's gap alone names the consumer; with the second read it is not named
    assert not_subscribed([CONSUMER], set(), first, grace=3.0) != []
    assert not_subscribed([CONSUMER], set(), most_consumers(first, second), grace=3.0) == []


def test_a_consumer_either_management_look_lists_is_not_named() -> None:
    # the broker counts one consumer short both times; the management API's first list
    # misses this consumer (its renewal was not sampled yet), the second lists it
    short = {"team-a": QueueInfo(0, 0)}
    first = {("team-a", "triggerflow-consumer:team-a@other:9")}
    second = {("team-a", "triggerflow-consumer:team-a@h:1")}
    named = not_subscribed([CONSUMER], first, short, grace=3.0)
    assert [u["consumer_id"] for u in named] == [7]
    assert not_subscribed([CONSUMER], subscribed_in_either(first, second), short,
                          grace=3.0) == [{
        "queue": "team-a", "consumer_id": None, "host": None, "pid": None,
        "problem": ("queue team-a: 1 consumer(s) hold a lease below capacity but 0 are "
                    "subscribed on the broker")}]
    # a second look that failed keeps the first
    assert subscribed_in_either(first, None) == first
