"""The process's own health endpoint: ``/livez``, ``/readyz`` and ``/metrics`` on one port.

Probes are answered from state the process already keeps, never by a query: each component
registers named checks (a function returning why it is not working, or None), and the loop
stamps a tick twice a second. The server runs in threads of its own, so a blocked event loop
is reported (503) rather than left to time a probe out.

* ``/livez``: 200 while the event loop ticks; 503 once it has not for ``LOOP_STALL`` seconds.
* ``/readyz``: 200 only while every check passes (the loop's among them); 503 otherwise.

Both answer a small JSON object naming each check and, for a failing one, why.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any

LIVEZ = "/livez"
READYZ = "/readyz"
LOOP_STALL = 5.0  # seconds without a tick before the loop counts as unresponsive
TICK = 0.5  # seconds between the loop's ticks

# Why a part of the process is not working, or None when it is. Called in a server thread:
# it may read attributes the loop writes, never await or take the loop's locks.
Check = Callable[[], str | None]


class Health:
    """Named checks and the loop's last tick; thread-safe to read."""

    def __init__(self) -> None:
        self._checks: dict[str, Check] = {}
        self._lock = threading.Lock()
        self._last_tick: float | None = None  # monotonic; None: no loop watched yet
        self._loop: asyncio.AbstractEventLoop | None = None

    def check(self, name: str, probe: Check) -> None:
        """Add (or replace) the check ``name``."""
        with self._lock:
            self._checks[name] = probe

    def watch_loop(self) -> None:
        """Stamp a tick from the running loop every ``TICK`` seconds (call from the loop)."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return  # already ticking
        self._loop = loop

        def tick() -> None:
            self._last_tick = time.monotonic()
            loop.call_later(TICK, tick)

        tick()
        self.check("loop", self._loop_problem)

    def _loop_problem(self) -> str | None:
        if self._last_tick is None:
            return None
        late = time.monotonic() - self._last_tick
        if late > LOOP_STALL:
            return f"event loop unresponsive for {late:.1f}s"
        return None

    def live(self) -> tuple[bool, dict[str, str]]:
        problem = self._loop_problem()
        return problem is None, {"loop": problem or "ok"}

    def ready(self) -> tuple[bool, dict[str, str]]:
        with self._lock:
            checks = dict(self._checks)
        if not checks:
            return False, {"process": "starting"}
        report: dict[str, str] = {}
        for name, probe in sorted(checks.items()):  # one order, whoever registered first
            try:
                report[name] = probe() or "ok"
            except Exception as exc:  # a check must never break the probe
                report[name] = f"check failed: {exc!r}"
        return all(v == "ok" for v in report.values()), report


_health = Health()


def get_health() -> Health:
    """The process's one :class:`Health`."""
    return _health


def serve(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve the three paths on ``port`` from a daemon thread; raises OSError if taken."""
    # Imported here: ``triggerflow health`` reads this module's paths and must start fast.
    from prometheus_client.exposition import MetricsHandler

    class Handler(MetricsHandler):
        """``/livez`` and ``/readyz`` from :func:`get_health`; any other path is ``/metrics``."""

        timeout = 10  # a client that stalls mid-request frees its thread

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == LIVEZ:
                self._answer(*_health.live())
            elif path == READYZ:
                self._answer(*_health.ready())
            else:
                super().do_GET()

        def _answer(self, ok: bool, report: dict[str, Any]) -> None:
            body = json.dumps({"status": "ok" if ok else "failing", "checks": report}).encode()
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="health-http", daemon=True).start()
    return server
