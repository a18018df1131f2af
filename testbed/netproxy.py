"""A TCP forwarder in the test's own event loop, standing for what sits between the processes
and a service: a cut cable (close it) or a load balancer in front of a cluster (several
targets: each new connection goes to the first that accepts, as HAProxy or a Kubernetes
Service would send it to a live node once the dead one fails its check). ``hold_replies``
and ``cut``: a request reaches the server and is carried out, and its connection drops before
the reply comes back."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field


@dataclass
class Proxy:
    server: asyncio.Server
    # (target, accepted) for every connection, in order: which node each one reached
    routed: list[tuple[tuple[str, int], bool]] = field(default_factory=list)
    links: set[asyncio.StreamWriter] = field(default_factory=set)
    marker: bytes | None = None  # hold_replies: what the held request's connection sent
    held: asyncio.Event = field(default_factory=asyncio.Event)  # a reply is being held
    _cut: asyncio.Event = field(default_factory=asyncio.Event)

    def hold_replies(self, marker: bytes) -> None:
        """On the next connection that prepares a statement whose text holds ``marker``,
        hold back every reply from that statement's first execution on, until ``cut``.
        (Its execution, not the next request: asyncpg may look up types in between.)"""
        self.marker = marker

    def cut(self) -> None:
        """Drop every connection open now (held replies are lost with them)."""
        self.marker = None
        self._cut.set()
        for link in self.links:
            link.close()
        self.links.clear()

    def to(self, target: tuple[str, int]) -> int:
        return sum(1 for t, ok in self.routed if ok and t == target)

    def watch(self, link: dict[str, bytes], data: bytes) -> None:
        """Arm on the prepare (``Parse``: asyncpg's statement name, then the text); hold
        once a ``Bind`` names that statement."""
        assert self.marker is not None
        if "name" not in link:
            found = re.search(rb"(__asyncpg_stmt_\w+?__)\x00[^\x00]*" + re.escape(self.marker),
                              data)
            if found is None:
                return
            link["name"] = found.group(1)
            data = data[found.end():]
        bind = rb"B[\s\S]{4}[^\x00]*\x00" + re.escape(link["name"]) + rb"\x00"  # Bind: portal, name
        if re.search(bind, data):
            link["holding"] = b"1"
            self.held.set()


@contextlib.asynccontextmanager
async def tcp_proxy(port: int, *targets: tuple[str, int]) -> AsyncIterator[Proxy]:
    """Forward ``127.0.0.1:port`` to the first of ``targets`` that accepts each connection;
    leaving the block cuts every connection."""
    proxy: Proxy

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   link: dict[str, bytes] | None = None, reply: bool = False) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if link is not None and not reply and proxy.marker is not None:
                    proxy.watch(link, data)
                if link is not None and reply and link.get("holding"):
                    await proxy._cut.wait()  # held until cut: the reply never arrives
                    break
                writer.write(data)
                await writer.drain()
        writer.close()

    async def upstream(
        order: Sequence[tuple[str, int]],
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for target in order:
            try:
                pair = await asyncio.open_connection(*target)
            except OSError:
                proxy.routed.append((target, False))
                continue
            proxy.routed.append((target, True))
            return pair
        return None

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = await upstream(targets)
        if up is None:
            writer.close()
            return
        up_reader, up_writer = up
        proxy.links.update((writer, up_writer))
        link: dict[str, bytes] = {}
        await asyncio.gather(pipe(reader, up_writer, link),
                             pipe(up_reader, writer, link, reply=True))

    server = await asyncio.start_server(accept, "127.0.0.1", port)
    proxy = Proxy(server)
    try:
        yield proxy
    finally:
        server.close()
        proxy.cut()
