"""The consumer: claims delivered triggers, runs them, emits their events.

``consumer`` holds the loops and the ack decision and builds the parts, handing each the
shared ``context``; ``admission`` what is let in, the room left and its own state (the
reaper's and probation's view of the consumer); ``messages`` the wake-ups it re-sends and
the unreadable messages it dead-letters; ``starting`` starts what was claimed; ``outcomes``
turns fired results into events (nothing once fenced by ``triggerflow.lease``);
``probation`` runs suspects in halving groups; ``rebalance`` is the fair-share arithmetic;
``observe`` the gauges and the watchdog.
"""

from triggerflow.consumer.consumer import Consumer

__all__ = ["Consumer"]
