"""The lease's own arithmetic, in-process: its deadline never outlives the row it renewed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from triggerflow.lease import Lease, LeaseLost
from triggerflow.store import ProcessKind, Renewal


class SlowStore:
    """Answers register and renew after ``delay`` seconds, as a loaded database would."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.expired = False

    async def register(self, *args: Any) -> int:
        await asyncio.sleep(self.delay)
        return 7

    async def renew(self, *args: Any, **kwargs: Any) -> Renewal | None:
        await asyncio.sleep(self.delay)
        return None if self.expired else Renewal(0, 0, 0, time.time())


@pytest.mark.parametrize(("ttl", "interval"), [(2.0, 0.5), (10.0, 1.0), (30.0, 10.0), (1.0, 0.2)])
def test_budget_is_shorter_than_the_ttl(ttl: float, interval: float) -> None:
    lease = Lease(SlowStore(0), ProcessKind.CONSUMER, ttl=ttl, renew_interval=interval)  # type: ignore[arg-type]
    assert 0 < lease.budget < ttl


async def test_a_slow_renewal_does_not_stretch_the_deadline_past_the_row() -> None:
    """The row expires at the database's now() + ttl, and that now() can be as early as the
    moment the renewal was sent: the deadline counts from then, not from the answer."""
    store = SlowStore(0.3)
    lease = Lease(store, ProcessKind.CONSUMER, ttl=2.0, renew_interval=0.5)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    sent = loop.time()
    await lease.register()
    assert lease.deadline <= sent + lease.ttl - 0.2  # from the answer: sent + 0.3 + 1.75
    sent = loop.time()
    await lease.renew(0)
    assert lease.deadline <= sent + lease.ttl - 0.2  # from the answer: sent + 0.3 + 1.75
    assert lease.valid()
    store.expired = True
    with pytest.raises(LeaseLost, match="expired"):
        await lease.renew(0)
