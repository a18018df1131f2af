"""Fired outcomes -> stamped events for the sink, unless the lease says we are fenced."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from triggerflow import telemetry
from triggerflow.emitter import EventSink
from triggerflow.lease import Lease
from triggerflow.model import EventKind, FailureReason
from triggerflow.runner import Held, failure
from triggerflow.settings import Settings
from triggerflow.telemetry import context_from, current_traceparent, get_metrics, tracer, tracing_enabled
from triggerflow.wire import Event, validate_payload

log = logging.getLogger(__name__)

# A mode's own payload encoding (Airflow's serialisers), applied before validation.
EncodeFn = Callable[[EventKind, Any], tuple[EventKind, Any]]


class Outcomes:
    """Validates a trigger's outcome, stamps it with (trigger id, attempt), queues it.

    Past the lease's deadline nothing is emitted: a peer may run the trigger now and our
    event would be stale (the store would ignore it anyway; this keeps it off the wire).
    A payload that is not JSON or too big becomes a ``fail`` event naming the class.
    """

    def __init__(self, sink: EventSink, lease: Lease, settings: Settings,
                 on_fired: Callable[[Sequence[Held]], None], encode: EncodeFn | None = None) -> None:
        self.sink = sink
        self.encode = encode
        self.lease = lease
        self.max_event_bytes = settings.max_event_bytes
        self.on_fired = on_fired
        self.metrics = get_metrics()
        self._succeeded: dict[str, int] = {}  # queue -> fired since the last count flush

    def emit(self, held: Held, kind: EventKind, payload: Any) -> None:
        self.emit_many((held,), kind, payload)

    def emit_many(self, helds: Sequence[Held], kind: EventKind, payload: Any) -> None:
        """One outcome for several triggers (timers of one class due at one instant): encoded,
        validated, stamped and counted once, not once per trigger."""
        if not helds or not self.lease.valid():
            return
        if self.encode is not None:
            kind, payload = self.encode(kind, payload)
        reason: str | None = None
        try:
            text = validate_payload(payload, self.max_event_bytes)
        except Exception as exc:  # PayloadError, or whatever else a payload's encoding raises
            reason = FailureReason.TRIGGER_FAILURE
            kind, fallback = EventKind.FAIL, failure(FailureReason.TRIGGER_FAILURE,
                                                     f"{helds[0].classpath}: {exc}")
            if self.encode is not None:
                kind, fallback = self.encode(kind, fallback)
            text = validate_payload(fallback, 1 << 20)
        fired = time.time()
        name = str(kind)
        if tracing_enabled():
            self.sink.add_many([
                Event(held.id, held.attempt, held.queue, name, text, fired,
                      self._fire_span(held, kind) if held.traceparent else None)
                for held in helds])
        else:
            self.sink.add_many([Event(held.id, held.attempt, held.queue, name, text, fired)
                                for held in helds])
        if kind == EventKind.FAIL:
            if reason is None and isinstance(payload, dict):
                reason = payload.get("error")
            label = str(reason or FailureReason.TRIGGER_FAILURE)
            for queue, n in Counter(held.queue for held in helds).items():
                self.metrics.failed.add(n, {"queue": queue, "reason": label})
        else:
            self._count_succeeded(helds)
        if log.isEnabledFor(logging.DEBUG):
            for held in helds:
                log.debug("fired %s", kind, extra=held.log_context())
        self.on_fired(helds)

    def _count_succeeded(self, helds: Sequence[Held]) -> None:
        """Count per loop pass, not per event: a burst fires thousands in one pass, and a
        counter add costs ~1.6 us (16 ms of a 10,000-trigger burst)."""
        if not self._succeeded:
            asyncio.get_running_loop().call_soon(self._flush_counts)
        counts = self._succeeded
        for queue, n in Counter(held.queue for held in helds).items():
            counts[queue] = counts.get(queue, 0) + n

    def _flush_counts(self) -> None:
        counts, self._succeeded = self._succeeded, {}
        for queue, n in counts.items():
            self.metrics.succeeded.add(n, {"queue": queue})

    @staticmethod
    def _fire_span(held: Held, kind: EventKind) -> str | None:
        """A span for the run, parented on the defer span; only its id outlives this call."""
        with tracer.start_as_current_span(
            telemetry.SPAN_FIRE, context=context_from(held.traceparent),
            attributes={telemetry.ATTR_TRIGGER_ID: held.id, telemetry.ATTR_QUEUE: held.queue,
                        telemetry.ATTR_EVENT: str(kind), telemetry.ATTR_ATTEMPT: held.attempt},
        ):
            return current_traceparent()
