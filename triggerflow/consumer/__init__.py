"""The consumer: claims delivered triggers, runs them, emits their events.

``consumer`` holds the loops and the ack decision; ``lease`` the process's row and fencing;
``outcomes`` turns fired results into events; ``rebalance`` the fair-share arithmetic;
``observe`` gauges and the watchdog.
"""

from triggerflow.consumer.consumer import Consumer
from triggerflow.consumer.lease import Lease, LeaseLost

__all__ = ["Consumer", "Lease", "LeaseLost"]
