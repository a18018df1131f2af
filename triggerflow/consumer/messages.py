"""What a consumer sends and receives beside its claims: wake-ups for triggers it hands back,
and messages it cannot read (dead-lettered, never retried)."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

from triggerflow.store import TriggerRef
from triggerflow.telemetry import get_metrics
from triggerflow.transport import Delivery, Transport
from triggerflow.wire import WireError

log = logging.getLogger(__name__)
T = TypeVar("T")


async def republish(transport: Transport, refs: Sequence[TriggerRef]) -> None:
    """Wake the consumers of each ref's queue for it (one message per queue)."""
    by_queue: dict[str, list[int]] = defaultdict(list)
    for ref in refs:
        by_queue[ref.queue].append(ref.id)
    if by_queue:
        await transport.publish_wakeups(by_queue)


async def decoded(transport: Transport, message: Delivery, decode: Callable[[bytes], T]) -> T | None:
    """The decoded message, or None when it was unreadable and is now dead-lettered."""
    try:
        return decode(message.body)
    except WireError as exc:
        await dead_letter(transport, message, str(exc))
        return None


async def dead_letter(transport: Transport, message: Delivery, reason: str) -> None:
    log.warning("dead-lettering a message from %s: %s", message.routing_key, reason)
    get_metrics().dead_lettered.add(1, {"reason": reason.split(":")[0]})
    try:
        await transport.dead_letter(message.body, reason, source=message.routing_key)
        await message.ack()
    except Exception:
        await message.reject(requeue=False)  # the queue's DLX still keeps it
