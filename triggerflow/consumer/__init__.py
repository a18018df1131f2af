"""The consumer: claims delivered triggers, runs them, emits their events.

``consumer`` holds the loops and the ack decision; ``admission`` what is let in and the room
left (the reaper's and probation's view of the consumer); ``starting`` starts what was
claimed; ``outcomes`` turns fired results into events (nothing once fenced by
``triggerflow.lease``); ``probation`` runs suspects in halving groups; ``rebalance`` is the
fair-share arithmetic; ``observe`` the gauges and the watchdog.
"""

from triggerflow.consumer.consumer import Consumer

__all__ = ["Consumer"]
