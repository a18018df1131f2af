"""The consumer's cancel sweep: held triggers whose task moved on are stopped.

Every ``cancel_sweep_interval`` the store says which triggers' tasks left them
(``Store.sweep_cancelled``) and the consumer stops those it runs (``cleanup()`` runs; their
bookkeeping goes). Where the mode's store can also say *when* to look
(``Capabilities.cancel_signal``: Airflow mode's LISTEN on its cancel log,
``airflow/cancels.py``), the signal wakes the sweep at once, so a trigger stops within
milliseconds of its task's end instead of within the interval; the interval stays as the
backstop for a signal lost while reconnecting. Nothing is read while nothing is held, so an
idle consumer costs no statement here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from triggerflow.store import CancelSignal, ClaimStore, StoreError

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)


class CancelSweep:
    """Runs ``sweep`` every ``interval`` seconds, and at once when ``watch`` (the mode's
    ``Capabilities.cancel_signal``, if any) signals."""

    def __init__(
        self,
        store: ClaimStore,
        me: Callable[[], int],
        held: Callable[[], bool],
        cancel: Callable[[list[int]], Awaitable[int]],
        interval: float,
        watch: CancelSignal | None = None,
    ) -> None:
        self.store = store
        self.watch = watch
        self.me = me
        self.held = held
        self.cancel = cancel
        self.interval = interval
        self.signal = asyncio.Event()

    @classmethod
    def of(cls, context: ConsumerContext, cancel: Callable[[list[int]], Awaitable[int]],
           watch: CancelSignal | None) -> CancelSweep:
        lease, runner = context.lease, context.runner  # ``me`` changes on a fence
        return cls(context.store, lambda: lease.me, lambda: bool(runner.running), cancel,
                   context.settings.cancel_sweep_interval.total_seconds(), watch)

    async def run(self) -> None:
        watching: AbstractAsyncContextManager[None] = (
            contextlib.nullcontext() if self.watch is None else self.watch(self.signal.set))
        async with watching:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.signal.wait(), self.interval)
                # cleared before the read: a signal arriving during it sweeps again
                self.signal.clear()
                if self.held():
                    await self.sweep()

    async def sweep(self) -> int:
        try:
            ids = await self.store.sweep_cancelled(self.me())
            return await self.cancel(ids) if ids else 0
        except StoreError as exc:  # transient: the next sweep tries again
            log.warning("cancel sweep failed: %r", exc)
            return 0
