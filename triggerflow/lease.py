"""A process's lease on the store: register, renew on time, know when it is fenced.

The lease lives on the process's own row, so renewing costs one statement per interval
whatever the number of triggers held. The deadline is kept on the loop's clock: past it, a
peer may already have taken our triggers over, so nothing we fire may be published.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Sequence

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential_jitter

from triggerflow import __version__
from triggerflow.store import ProcessKind, Renewal, Store, StoreError

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Our row expired: every trigger we hold may already run elsewhere."""


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("cannot register (%r); retrying", exc)


class Lease:
    """The row of one consumer or writer. ``ttl`` seconds unrenewed and it is dead."""

    def __init__(self, store: Store, kind: ProcessKind, *, queues: Sequence[str] = (),
                 capacity: int = 0, ttl: float, renew_interval: float) -> None:
        self.store = store
        self.kind = kind
        self.queues = list(queues)
        self.capacity = capacity
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.host = socket.gethostname()
        self.me = 0
        self.deadline = 0.0  # loop time by which the next renewal must succeed

    @property
    def budget(self) -> float:
        """How long after a renewal our triggers are surely still ours."""
        return self.ttl - min(0.5, self.renew_interval / 2)

    def valid(self) -> bool:
        return asyncio.get_running_loop().time() <= self.deadline

    async def register(self) -> int:
        """Register (retrying while the store is down); returns the new id."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(StoreError),
            wait=wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5),
            before_sleep=_log_retry,
        ):
            with attempt:
                sent = asyncio.get_running_loop().time()
                self.me = await self.store.register(
                    self.kind, self.host, os.getpid(), self.queues, self.capacity, __version__,
                    self.ttl)
        self.deadline = sent + self.budget
        log.info("registered as %s %s for %s", self.kind, self.me, ",".join(self.queues) or "all",
                 extra={"consumer_id": self.me})
        return self.me

    async def renew(self, running: int) -> Renewal:
        """Extend the lease before the deadline; raises LeaseLost when that is impossible
        (expired in the store, overdue, or the store answered too late) and StoreError when
        the store failed this once (the next renewal may still make it)."""
        loop = asyncio.get_running_loop()
        # The row's new expiry is the database's now() + ttl, and that now() is no earlier
        # than this moment: counting the budget from here, not from the answer, keeps a slow
        # renewal from stretching our deadline past the row's.
        sent = loop.time()
        remaining = self.deadline - sent
        if remaining <= 0:
            raise LeaseLost("renewal overdue (loop stalled or database unreachable)")
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the inner call completes, and the loop then never stops.
            async with asyncio.timeout(remaining):
                result = await self.store.renew(self.me, self.ttl, running, self.queues)
        except TimeoutError:
            raise LeaseLost("renewal timed out") from None
        if result is None:
            raise LeaseLost("lease had expired in the database")
        self.deadline = sent + self.budget
        return result

    async def leave(self) -> None:
        await self.store.unregister(self.me)
