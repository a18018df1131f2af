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
import time
from collections.abc import Callable, Sequence

from tenacity import wait_exponential_jitter

from triggerflow import __version__
from triggerflow.errors import TriggerflowError
from triggerflow.refusals import Refusals
from triggerflow.skew import ClockCheck
from triggerflow.store import LeaseStore, ProcessKind, Renewal, StoreAccessRefused, StoreError

log = logging.getLogger(__name__)


class LeaseLost(TriggerflowError):
    """Our row expired: every trigger we hold may already run elsewhere."""


class Lease:
    """The row of one consumer or writer. ``ttl`` seconds unrenewed and it is dead.

    Also what readiness reads of it (:meth:`problem`, :meth:`database_problem`): when it was
    last renewed and how the last round-trip to the store went, on the monotonic clock.
    Each :meth:`renew` measures ``clock`` (the wall clock triggers are timed on) against the
    database's into :attr:`clock_check`, whose bound is ``max_clock_skew`` seconds.
    """

    def __init__(self, store: LeaseStore, kind: ProcessKind, *, queues: Sequence[str] = (),
                 capacity: int = 0, ttl: float, renew_interval: float,
                 max_clock_skew: float = float("inf"),
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.kind = kind
        self.queues = list(queues)
        self.capacity = capacity
        self.ttl = ttl
        self.renew_interval = renew_interval
        self.host = socket.gethostname()
        self.me = 0
        self.deadline = 0.0  # loop time by which the next renewal must succeed
        self.renewed_at: float | None = None  # monotonic; None: not registered (or fenced)
        self.store_ok_at: float | None = None  # monotonic time of the last store round-trip
        self.store_error: str | None = None  # why the last round-trip failed, if it did
        self.refusals = Refusals("the database", StoreAccessRefused, log)
        self.clock = clock
        self.clock_check = ClockCheck(max_clock_skew)

    def _stored(self, error: BaseException | None) -> None:
        """Record a round-trip to the store (None: it went through)."""
        if error is None:
            self.store_ok_at, self.store_error = time.monotonic(), None
        else:
            self.store_error = f"{type(error).__name__}: {error}"

    def problem(self) -> str | None:
        """Why the lease does not hold, or None."""
        if self.renewed_at is None:
            return "not registered" + (f" ({self.store_error})" if self.store_error else "")
        age = time.monotonic() - self.renewed_at
        if age > self.ttl:
            return f"not renewed for {age:.1f}s (lease TTL {self.ttl:g}s)"
        return None

    def database_problem(self) -> str | None:
        """Why the store is not answering, or None (fed by the lease's own round-trips)."""
        if self.store_error is not None:
            return self.store_error
        if self.store_ok_at is None:
            return "no round-trip yet"
        age = time.monotonic() - self.store_ok_at
        if age > self.ttl:
            return f"no round-trip for {age:.1f}s"
        return None

    @property
    def budget(self) -> float:
        """How long after a renewal our triggers are surely still ours."""
        return self.ttl - min(0.5, self.renew_interval / 2)

    def valid(self) -> bool:
        return asyncio.get_running_loop().time() <= self.deadline

    def holds(self, me: int) -> bool:
        """Whether the lease is still valid under the id ``me`` (read before a claim or a
        take-over): False once fenced or registered anew while the statement ran."""
        return me == self.me and self.valid()

    async def register(self) -> int:
        """Register (retrying while the store is down); returns the new id. Raises
        StoreAccessRefused once the store refused our credentials ``ACCESS_ATTEMPTS`` times in
        a row: a wrong password does not heal by waiting."""
        async for attempt in self.refusals.retrying(
                StoreError, wait_exponential_jitter(multiplier=0.5, max=5, jitter=0.5)):
            with attempt:
                sent = asyncio.get_running_loop().time()
                try:
                    self.me = await self.store.register(
                        self.kind, self.host, os.getpid(), self.queues, self.capacity,
                        __version__, self.ttl)
                except StoreError as exc:
                    self._stored(exc)
                    raise
        self._stored(None)
        self.refusals.reset()
        self.renewed_at = time.monotonic()
        self.deadline = sent + self.budget
        log.info("registered as %s %s for %s", self.kind, self.me, ",".join(self.queues) or "all",
                 extra={"consumer_id": self.me})
        return self.me

    async def renew(self, running: int, *, subscribed: bool = True,
                    warming: bool = False) -> Renewal:
        """Extend the lease before the deadline; raises LeaseLost when that is impossible
        (expired in the store, overdue, or the store answered too late) and StoreError when
        the store failed this once (the next renewal may still make it). ``subscribed``:
        whether we are subscribed on the broker (only then are we counted as capacity)."""
        loop = asyncio.get_running_loop()
        # The row's new expiry is the database's now() + ttl, and that now() is no earlier
        # than this moment: counting the budget from here, not from the answer, keeps a slow
        # renewal from stretching our deadline past the row's.
        sent, sent_wall = loop.time(), self.clock()
        remaining = self.deadline - sent
        if remaining <= 0:
            self.renewed_at = None
            raise LeaseLost("renewal overdue (loop stalled or database unreachable)")
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the inner call completes, and the loop then never stops.
            async with asyncio.timeout(remaining):
                result = await self.store.renew(self.me, self.ttl, running, self.queues,
                                                subscribed=subscribed,
                                                clock_skew=self.clock_check.skew,
                                                warming=warming)
        except TimeoutError:
            self._stored(TimeoutError("renewal timed out"))
            self.renewed_at = None
            raise LeaseLost("renewal timed out") from None
        except StoreError as exc:
            self._stored(exc)
            raise
        self._stored(None)
        if result is None:
            self.renewed_at = None
            raise LeaseLost("lease had expired in the database")
        self.clock_check.measure(sent_wall, loop.time() - sent, result.db_time)
        self.renewed_at = time.monotonic()
        self.deadline = sent + self.budget
        return result

    async def register_anew(self) -> int:
        """After :class:`LeaseLost`: invalid at once (nothing is claimed or emitted under the
        old id meanwhile), then registered under a new id, which it returns."""
        self.deadline = 0.0
        return await self.register()

    async def keep(self, *, subscribed: bool) -> None:
        """Renew a lease that fences nothing (a writer holds no triggers): no deadline, and
        registered anew when it had expired."""
        try:
            renewed = await self.store.renew(self.me, self.ttl, 0, self.queues,
                                             subscribed=subscribed)
        except StoreError as exc:
            self._stored(exc)
            raise
        self._stored(None)
        if renewed is None:
            self.renewed_at = None
            await self.register()
        self.renewed_at = time.monotonic()

    async def leave(self) -> None:
        await self.store.unregister(self.me)
