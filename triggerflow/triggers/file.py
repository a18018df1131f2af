"""Fires when a path appears on disk."""

from __future__ import annotations

import asyncio
import glob
from collections.abc import AsyncIterator
from typing import Any

from triggerflow.triggers.base import BaseTrigger, TriggerEvent


class FileTrigger(BaseTrigger):
    """Fires with the matching paths once ``filepath`` (a glob) matches something.

    ``stat`` on a network filesystem can block for seconds, so it runs in a worker thread.
    """

    def __init__(self, filepath: str, poke_interval: float = 5.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filepath = filepath
        self.poke_interval = poke_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggerflow.triggers.file.FileTrigger",
            {"filepath": self.filepath, "poke_interval": self.poke_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            found = await asyncio.to_thread(glob.glob, self.filepath, recursive=True)
            if found:
                self.log.debug("found %s", found[0])
                yield TriggerEvent({"path": sorted(found)[0], "matches": len(found)})
                return
            await asyncio.sleep(self.poke_interval)
