"""The coroutine trigger of ``triggerflow bench chaos``: waits until a moment and names its
deferral in its event, so the checker can tell whose event was applied to a task."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from triggerflow.triggers.base import BaseTrigger, TaskSuccessEvent, TriggerEvent


class ChaosWait(BaseTrigger):
    """Fires at ``until`` (POSIX time; a run taken over waits for the same moment) with
    ``{"d": token}``: a resume, or with ``end`` a task-end ``success`` carrying it as XComs."""

    def __init__(self, until: float, token: str, end: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.until = until
        self.token = token
        self.end = end

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return ("bench.chaos_trigger.ChaosWait",
                {"until": self.until, "token": self.token, "end": self.end})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(max(0.0, self.until - time.time()))
        if self.end:
            yield TaskSuccessEvent(xcoms={"d": self.token})
        else:
            yield TriggerEvent({"d": self.token})


class ChaosBad(BaseTrigger):
    """The bad triggers of the nemesis's ``bad_trigger`` fault, one per ``variant``; each
    must end only its own task, as ``docs/security.md`` says:

    - ``raise``: raises (its task fails, ``Trigger failure``);
    - ``hang``: never yields (deferred with a timeout: ``Trigger timeout``);
    - ``block``: blocks the event loop (``time.sleep``) on every run, past ``block_limit``
      and under the lease (quarantined after ``max_blocks`` runs: ``Trigger quarantined``);
    - ``garbage``: yields a dict, not an event (``Trigger failure`` naming the mistake);
    - ``kwargs``: serializes kwargs its class cannot be built from (``Trigger could not be
      loaded``; the SDK stores kwargs without building the class).
    """

    BLOCK = 1.6  # seconds: past block_limit (1 s), short of the lease (lease_ttl 3 s)

    def __init__(self, variant: str, token: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.variant = variant
        self.token = token

    def serialize(self) -> tuple[str, dict[str, Any]]:
        if self.variant == "kwargs":  # no ``variant``: __init__ cannot be called with these
            return ("bench.chaos_trigger.ChaosBad", {"token": self.token, "bogus": [1, 2]})
        return ("bench.chaos_trigger.ChaosBad", {"variant": self.variant, "token": self.token})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await asyncio.sleep(0.2)
        if self.variant == "raise":
            raise RuntimeError(f"chaos: {self.token} raises")
        if self.variant == "block":
            time.sleep(self.BLOCK)  # noqa: ASYNC251 -- blocking the loop is the point
        if self.variant == "garbage":
            yield {"d": self.token}  # type: ignore[misc]  # not a TriggerEvent: the point
            return
        await asyncio.Event().wait()  # hang (and a block that was let go on): never yields
        yield TriggerEvent({"d": self.token})
