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

from triggerflow import presence
from triggerflow.lease import Lease
from triggerflow.store import PresenceStore, StoreError
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Transport

log = logging.getLogger(__name__)


class Presence(presence.Presence):
    """A consumer's presence: named on its row, and its peers' heard going (writers' too).

    ``reap_now`` is the reaper's wake-up; it is set when a peer of ``queues`` was ended here.
    ``peer_left`` is called whenever another consumer's connection closes, whether or not
    its lease was still ours to end (one that unregistered first leaves no lease behind).
    """

    def __init__(
        self, store: PresenceStore, transport: Transport, lease: Lease, queues: Sequence[str],
        reap_now: asyncio.Event, peer_left: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(store, transport, lease)
        self.queues = list(queues)
        self.reap_now = reap_now
        self.peer_left = peer_left

    def _heard(self, name: str) -> None:
        self.peer_left()
        super()._heard(name)

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
            get_metrics().presence_lost.add(len(ids), {"kind": "consumer"})
            log.info(
                "consumer %s closed its broker connection (presence queue %s deleted): "
                "taking over its triggers now",
                ",".join(map(str, ids)),
                name,
            )
            self.reap_now.set()
            return
        await self.end_writer(name)  # not a peer's: maybe a writer's
