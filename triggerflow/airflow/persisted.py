"""Ack-mode shared streams: a broker message is acked only once what it made is committed.

Airflow 3.3's ``BaseEventTrigger.create_shared_stream_producer`` puts a shared stream in ack
mode: ``SharedStreamManager`` hands the producer a message to ack (commit, delete) only after
every trigger event derived from it was confirmed persisted. Airflow's triggerer confirms
from its supervisor, which stores the events. Here the writer stores them, in another
process, so:

- the consumer binds each event of an ack-mode trigger as it leaves the trigger
  (``SharedStreamManager.bind_pending_event``) and remembers the seq under the event's
  ``notice`` (trigger id and a digest of the body the writer will receive): ``Pending``;
- the writer's transaction that submits a watcher event also NOTIFYs ``CHANNEL`` with that
  notice (``orm``), which PostgreSQL delivers only if the transaction commits;
- the consumer LISTENs (``listening``, started by the first ack-mode trigger and connected
  before it subscribes) and confirms the seqs (``confirm_persisted``).

A notification that never comes (the consumer's LISTEN connection was reconnecting, or the
event was fenced out as stale and never committed) lets the manager's ``[triggerer]
shared_stream_ack_timeout`` fail the event: the producer does not ack it, the broker
redelivers it, and an asset event that was committed is recorded again (at least once, as
under Airflow's triggerer after a crash). Importing this module imports nothing from Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from triggerflow.wire import encode_json

log = logging.getLogger(__name__)

CHANNEL = "triggerflow_airflow_persisted"


def notice(trigger_id: int, body: str) -> str:
    """What the writer NOTIFYs once the event of ``trigger_id`` with wire ``body`` (the
    payload text the writer receives) is committed: short, whatever the body's size."""
    return f"{trigger_id}:{hashlib.blake2b(body.encode(), digest_size=8).hexdigest()}"


def wire_body(encoded: str) -> str:
    """The payload text the writer will receive for a watcher event encoded as ``encoded``
    (the consumer's ``Outcomes`` re-encodes it with ``wire.encode_json``)."""
    return encode_json(json.loads(encoded))


class Pending:
    """Seqs bound to events not yet confirmed persisted, by trigger and notice."""

    def __init__(self) -> None:
        self._seqs: dict[int, dict[str, deque[int]]] = {}
        self._dsn: str | None = None
        self._listener: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()
        self._stop = asyncio.Event()
        self.confirm: Callable[[list[int]], None] | None = None

    def expect(self, trigger_id: int, body: str, seq: int) -> None:
        key = notice(trigger_id, body)
        self._seqs.setdefault(trigger_id, {}).setdefault(key, deque()).append(seq)

    def forget(self, trigger_id: int) -> None:
        """The trigger stopped: its unconfirmed seqs are the manager's to time out."""
        self._seqs.pop(trigger_id, None)

    def persisted(self, payload: str) -> list[int]:
        """The seq a notification confirms (none if not ours: another consumer's)."""
        trigger_id = int(payload.split(":", 1)[0])
        mine = self._seqs.get(trigger_id)
        seqs = mine.get(payload) if mine else None
        if not seqs:
            return []
        seq = seqs.popleft()
        if not seqs:
            del mine[payload]  # type: ignore[union-attr]
        return [seq]

    @contextlib.asynccontextmanager
    async def serving(self, dsn: str, confirm: Callable[[list[int]], None]
                      ) -> AsyncIterator[None]:
        """The consumer's lifetime: where to LISTEN once an ack-mode trigger starts."""
        self._dsn, self.confirm = dsn, confirm
        self._connected, self._stop = asyncio.Event(), asyncio.Event()  # this loop's
        try:
            yield
        finally:
            self._stop.set()
            if self._listener is not None:
                self._listener.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._listener
            self._listener, self._dsn, self.confirm = None, None, None

    async def listening(self, timeout: float = 30.0) -> None:
        """LISTEN (once per consumer), connected before this returns, so no confirmation
        of an event the caller is about to emit is sent while nobody listens."""
        from triggerflow.airflow.wakeups import listen_channel

        if self._dsn is None:
            raise RuntimeError("ack-mode streams need the consumer's database (Pending.serving)")
        if self._listener is None:
            self._listener = asyncio.create_task(listen_channel(
                self._dsn, CHANNEL, self._handle, self._stop,
                on_connected=self._connected.set), name="airflow-persisted-listen")
        await asyncio.wait_for(self._connected.wait(), timeout)

    async def _handle(self, payload: str) -> None:
        try:
            seqs = self.persisted(payload)
        except ValueError:
            log.warning("ignored a malformed %s notification: %r", CHANNEL, payload[:100])
            return
        if seqs and self.confirm is not None:
            self.confirm(seqs)


PENDING = Pending()
