"""The broker's own view of the team queues, read from the RabbitMQ management HTTP API,
and the one thing AMQP cannot declare: policies (the team queues' length limits).

AMQP can only ask about a queue by name; the management API lists what exists, so a team
queue that the database has never heard of (declared, bound, and consumed by nobody) still
shows up in ``triggerflow status``. A team queue is any queue bound to one of the
namespace's deferral exchanges (``<ns>.deferrals.<queue>``, or the shared ``<ns>.deferrals``
of older versions).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import httpx

from triggerflow.errors import TriggerflowError

# A writer polls the API: its requests are not news at INFO.
logging.getLogger("httpx").setLevel(logging.WARNING)

DEFAULT_PORT = 15672
TIMEOUT = 5.0


class ManagementUnavailable(TriggerflowError):
    """The management API could not be asked (down, plugin off, refused credentials)."""


@dataclass(frozen=True)
class BrokerQueue:
    name: str
    ready: int  # messages waiting for a consumer
    unacked: int  # delivered, not yet acknowledged
    consumers: int


def default_management_url(amqp_url: str) -> str:
    """The AMQP URL's credentials and host on the management plugin's default port (http)."""
    parts = urlsplit(amqp_url)
    userinfo = ""
    if parts.username is not None:
        userinfo = parts.username + (f":{parts.password}" if parts.password is not None else "")
        userinfo += "@"
    return urlunsplit(("http", f"{userinfo}{parts.hostname or 'localhost'}:{DEFAULT_PORT}",
                       "/", "", ""))


def vhost_of(amqp_url: str) -> str:
    path = urlsplit(amqp_url).path
    return unquote(path[1:]) if len(path) > 1 else "/"


class ManagementClient:
    """A few read-only calls of the management API. ``url`` may carry credentials
    (``http://user:password@host:15672/``); without them the AMQP default guest/guest is
    not assumed, the API answers 401 and ``ManagementUnavailable`` says so."""

    def __init__(self, url: str, timeout: float = TIMEOUT) -> None:
        parts = urlsplit(url)
        self.base = urlunsplit((parts.scheme, f"{parts.hostname}:{parts.port or DEFAULT_PORT}",
                                parts.path.rstrip("/"), "", ""))
        auth = None
        if parts.username is not None:
            auth = (unquote(parts.username), unquote(parts.password or ""))
        self._client = httpx.AsyncClient(auth=auth, timeout=timeout)

    async def __aenter__(self) -> ManagementClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def _call(self, method: str, path: str, ok: tuple[int, ...], *,
                    params: dict[str, str] | None = None, body: Any = None) -> httpx.Response:
        try:
            response = await self._client.request(method, f"{self.base}/api/{path}",
                                                  params=params, json=body)
        except httpx.HTTPError as exc:
            raise ManagementUnavailable(
                f"RabbitMQ management API at {self.base} unreachable "
                f"({type(exc).__name__}: {exc or 'no answer'}); is the rabbitmq_management "
                "plugin enabled, and is TRIGGERFLOW_MANAGEMENT_URL right?") from exc
        if response.status_code not in ok:
            raise ManagementUnavailable(
                f"RabbitMQ management API at {self.base} answered {response.status_code} "
                f"for {method} {path} ({response.reason_phrase}: {response.text[:300]})")
        return response

    async def _get(self, path: str, **params: str) -> Any:
        response = await self._call("GET", path, (200, 404), params=params)
        return None if response.status_code == 404 else response.json()

    async def set_policy(self, vhost: str, name: str, body: dict[str, Any]) -> None:
        """Create or replace a policy (idempotent)."""
        await self._call("PUT", f"policies/{quote(vhost, safe='')}/{quote(name, safe='')}",
                         (201, 204), body=body)

    async def team_queues(self, vhost: str, deferrals_exchange: str) -> dict[str, BrokerQueue]:
        """Queues bound to a deferral exchange: ``deferrals_exchange`` itself or one named
        ``<deferrals_exchange>.<queue>`` (empty when there is none)."""
        v = quote(vhost, safe="")
        bindings = await self._get(f"bindings/{v}")
        names = {b["destination"] for b in bindings or []
                 if b.get("destination_type") == "queue"
                 and (b.get("source") == deferrals_exchange
                      or str(b.get("source", "")).startswith(deferrals_exchange + "."))}
        return await self.queues(vhost, names) if names else {}

    async def queues(self, vhost: str, names: set[str]) -> dict[str, BrokerQueue]:
        """The broker's numbers for those of ``names`` that exist."""
        rows = await self._get(
            f"queues/{quote(vhost, safe='')}",
            columns="name,messages_ready,messages_unacknowledged,consumers")
        return {
            r["name"]: BrokerQueue(r["name"], int(r.get("messages_ready") or 0),
                                   int(r.get("messages_unacknowledged") or 0),
                                   int(r.get("consumers") or 0))
            for r in rows or []
            if r["name"] in names
        }

    async def subscriptions(self, vhost: str) -> set[tuple[str, str]]:
        """(queue, the subscribing connection's client-provided name) for every consumer on
        the vhost; a connection that gave no name is listed by the broker's own name."""
        v = quote(vhost, safe="")
        connections = await self._get(f"vhosts/{v}/connections",
                                      columns="name,user_provided_name")
        named = {c["name"]: c.get("user_provided_name") or c["name"]
                 for c in connections or []}
        consumers = await self._get(f"consumers/{v}")
        found = set()
        for c in consumers or []:
            connection = (c.get("channel_details") or {}).get("connection_name", "")
            found.add((c["queue"]["name"], named.get(connection, connection)))
        return found
