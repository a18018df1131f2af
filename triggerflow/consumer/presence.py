"""Failover on the broker's word: a peer whose connection closed is taken over at once.

A killed process's kernel closes its sockets at once, and RabbitMQ deletes the presence
queue of that connection within milliseconds (``transport.presence``). Waiting for the
dead one's lease to expire instead costs up to ``lease_ttl``. What the broker cannot see --
a frozen process, whose socket stays open; a partition or a vanished host, until the
broker's heartbeat gives up -- is left to the lease, as before.

Ending the lease early keeps fencing exact: the peers take the triggers over through the
same ``REAP_DEAD`` rewrite that bumps each trigger's attempt, so an event of the old attempt
changes nothing, and a consumer wrongly declared gone finds its row expired at its next
renewal and fences itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from triggerflow.lease import Lease
from triggerflow.lifecycle import Background
from triggerflow.store import PresenceStore, StoreError
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Transport, TransportUnavailable

log = logging.getLogger(__name__)


class Presence:
    """A consumer's presence: named on its row, and its peers' heard going.

    ``reap_now`` is the reaper's wake-up; it is set when a peer of ``queues`` was ended here.
    ``peer_left`` is called whenever another consumer's connection closes, whether or not
    its lease was still ours to end (one that unregistered first leaves no lease behind).
    """

    def __init__(
        self, store: PresenceStore, transport: Transport, lease: Lease, queues: Sequence[str],
        reap_now: asyncio.Event, peer_left: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.transport = transport
        self.lease = lease
        self.queues = list(queues)
        self.reap_now = reap_now
        self.peer_left = peer_left
        self.name: str | None = None  # our connection's presence queue; None: presence off
        self._named_on = 0  # the consumer id whose row names it
        self._checks = Background()

    async def connected(self) -> None:
        """On each new broker connection: a new presence queue, named on our row."""
        try:
            self.name = await self.transport.watch_presence(self._heard)
        except TransportUnavailable:
            raise  # the connection went: the next one tries again
        except Exception:  # never worth our subscriptions: the lease still fails over
            log.exception("presence off on this connection; failover waits for the lease")
            self.name = None
        self._named_on = 0
        await self.announce()

    async def announce(self) -> None:
        """Name our presence queue on our current row, if not done yet (after a connect or a
        new registration); a failure is retried on the next call (each renewal)."""
        me = self.lease.me
        if self.name is None or self._named_on == me or not me:
            return
        try:
            if await self.store.announce_presence(me, self.name):
                self._named_on = me
        except StoreError as exc:
            log.warning("naming our presence queue failed (%r); retrying at the next renewal", exc)

    def _heard(self, name: str) -> None:
        self.peer_left()
        self._checks.spawn(self._gone(name))

    async def _gone(self, name: str) -> None:
        try:
            ids = await self.store.presence_gone(name, self.queues)
        except StoreError as exc:
            log.warning(
                "presence queue %s deleted, but ending its lease failed (%r); its lease will expire",
                name,
                exc,
            )
            return
        if ids:
            get_metrics().presence_lost.add(len(ids))
            log.info(
                "consumer %s closed its broker connection (presence queue %s deleted): "
                "taking over its triggers now",
                ",".join(map(str, ids)),
                name,
            )
            self.reap_now.set()
