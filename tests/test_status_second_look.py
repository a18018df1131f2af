"""``triggerflow status`` reads a queue the broker counts short of consumers a second time
before naming a consumer "not subscribed" (``status_report.most_consumers``): a consumer
renewing its subscriptions is absent for a few milliseconds, and CI caught ``status``
exiting 3 on a healthy consumer in that gap (tests/test_ops.py,
tests/test_status_writer.py)."""

from __future__ import annotations

from triggerflow.cli.status_report import most_consumers, not_subscribed
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
