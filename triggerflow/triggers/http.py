"""Fires when an HTTP endpoint answers with an expected status."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx

from triggerflow.triggers.base import BaseTrigger, TriggerEvent


class HttpTrigger(BaseTrigger):
    """Polls ``url`` until it answers one of ``expected_statuses``.

    Uses an async client, so a slow endpoint never holds up other triggers; connection
    errors and other statuses just mean "not yet".
    """

    def __init__(
        self,
        url: str,
        expected_statuses: list[int] | None = None,
        method: str = "GET",
        poke_interval: float = 5.0,
        request_timeout: float = 30.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.url = url
        self.expected_statuses = expected_statuses or [200]
        self.method = method
        self.poke_interval = poke_interval
        self.request_timeout = request_timeout
        self._client: httpx.AsyncClient | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "triggerflow.triggers.http.HttpTrigger",
            {
                "url": self.url,
                "expected_statuses": self.expected_statuses,
                "method": self.method,
                "poke_interval": self.poke_interval,
                "request_timeout": self.request_timeout,
            },
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self._client = httpx.AsyncClient(timeout=self.request_timeout)
        while True:
            try:
                response = await self._client.request(self.method, self.url)
            except httpx.HTTPError as exc:
                self.log.debug("poll of %s failed: %s", self.url, exc)
            else:
                if response.status_code in self.expected_statuses:
                    yield TriggerEvent({"url": self.url, "status": response.status_code})
                    return
            await asyncio.sleep(self.poke_interval)

    async def cleanup(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
