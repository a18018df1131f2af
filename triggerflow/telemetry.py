"""Every metric, span and log-context name, defined once.

Metrics are OpenTelemetry instruments, exposed on a Prometheus endpoint (``metrics_port``,
served by :mod:`triggerflow.health` beside ``/livez`` and ``/readyz``) and optionally over
OTLP. Names follow Airflow's triggerer where the meaning is the same (``triggers.running``,
``triggers.blocked_main_thread``, ``capacity_left``...) under a ``triggerflow.`` prefix.
Traces carry W3C ``traceparent`` through AMQP headers and the trigger row; a waiting trigger
holds only that string, never an open span.

Order does not matter: ``meter`` and ``tracer`` are the API's proxies, so instruments made
before ``setup()`` (a module that calls ``get_metrics()`` at import) are bound to the real
providers when ``setup()`` installs them; only measurements taken before that are dropped.
On the Prometheus endpoint a dot becomes ``_``, counters gain ``_total`` and histograms in
seconds ``_seconds`` (``triggerflow.event.latency`` -> ``triggerflow_event_latency_seconds``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_propagator = TraceContextTextMapPropagator()
tracer = trace.get_tracer("triggerflow")
meter = metrics.get_meter("triggerflow")

# Observable gauges registered by components (names here so every one is defined once).
RUNNING = "triggerflow.triggers.running"
CAPACITY_LEFT = "triggerflow.capacity_left"
QUEUE_DEPTH = "triggerflow.queue.depth"
QUEUE_CONSUMERS = "triggerflow.queue.consumers"
QUEUE_SUBSCRIBERS = "triggerflow.queue.subscribers"
QUEUE_UNSUBSCRIBED = "triggerflow.queue.unsubscribed"
QUEUE_BACKLOG = "triggerflow.queue.backlog_seconds"
QUEUE_OVERDUE = "triggerflow.queue.overdue"
UNSERVED_TRIGGERS = "triggerflow.unserved_triggers"  # Airflow mode's writer (airflow/liveness.py)
CLOCK_SKEW = "triggerflow.clock_skew_seconds"

# Spans (defer -> fire -> write share one trace) and their attributes.
SPAN_DEFER = "triggerflow.defer"
SPAN_FIRE = "triggerflow.fire"
SPAN_WRITE = "triggerflow.write"
ATTR_COUNT = "triggerflow.count"
ATTR_TRIGGER_ID = "triggerflow.trigger_id"
ATTR_QUEUE = "triggerflow.queue"
ATTR_EVENT = "triggerflow.event"
ATTR_ATTEMPT = "triggerflow.attempt"
ATTR_BATCH_SIZE = "triggerflow.batch_size"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


Observe = Callable[[], Iterable[tuple[float, dict[str, Any]]]]


class Metrics:
    """The instruments. Gauges are observed from callbacks registered by the component."""

    def __init__(self) -> None:
        m = meter
        self._gauges: dict[str, Observe] = {}
        self._gauge_lock = threading.Lock()
        self.claimed = m.create_counter(
            "triggerflow.triggers.claimed", description="Triggers claimed"
        )
        self.started = m.create_counter(
            "triggerflow.triggers.started", description="Triggers started"
        )
        self.emitted = m.create_counter(
            "triggerflow.events.emitted", description="Events published by kind"
        )
        self.succeeded = m.create_counter(
            "triggerflow.triggers.succeeded", description="Triggers that fired an event"
        )
        self.failed = m.create_counter(
            "triggerflow.triggers.failed", description="Trigger failures by reason"
        )
        self.cancelled = m.create_counter(
            "triggerflow.triggers.cancelled", description="Triggers cancelled on this consumer"
        )
        self.released = m.create_counter(
            "triggerflow.triggers.released", description="Triggers handed back to the queue"
        )
        self.blocked = m.create_counter(
            "triggerflow.triggers.blocked_main_thread",
            description="Times a trigger kept the event loop busy past the threshold",
        )
        self.loop_lag = m.create_histogram(
            "triggerflow.loop.lag", unit="s", description="Event-loop lag",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS,
        )
        self.latency = m.create_histogram(
            "triggerflow.event.latency", unit="s",
            description="Trigger fire -> task instance updated",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS,
        )
        self.applied = m.create_counter(
            "triggerflow.writer.events_applied", description="Events that moved a task, by kind"
        )
        self.ignored = m.create_counter(
            "triggerflow.writer.events_ignored",
            description="Duplicate, stale or cancelled events that changed nothing",
        )
        self.batch_size = m.create_histogram(
            "triggerflow.writer.batch_size", description="Events per writer transaction",
            explicit_bucket_boundaries_advisory=(1, 10, 50, 100, 500, 1000, 2000, 5000),
        )
        self.commit_time = m.create_histogram(
            "triggerflow.writer.commit_time", unit="s", description="Writer batch apply time",
            explicit_bucket_boundaries_advisory=_LATENCY_BUCKETS,
        )
        self.renewals = m.create_counter("triggerflow.lease.renewals", description="Lease renewals")
        self.leases_lost = m.create_counter(
            "triggerflow.lease.lost", description="Leases lost (fenced)"
        )
        self.dead_lettered = m.create_counter(
            "triggerflow.messages.dead_lettered", description="Messages dead-lettered by reason"
        )
        self.resent = m.create_counter(
            "triggerflow.reaper.resent", description="Triggers re-sent by the reaper by cause"
        )
        self.taken_over = m.create_counter(
            "triggerflow.reaper.taken_over",
            description="Triggers of dead consumers taken over by the reaping consumer",
        )
        self.presence_lost = m.create_counter(
            "triggerflow.reaper.presence_lost",
            description="Peers whose lease was ended when the broker saw their connection close",
        )
        self.quarantined = m.create_counter(
            "triggerflow.reaper.quarantined", description="Triggers quarantined"
        )
        self.timed_out = m.create_counter(
            "triggerflow.reaper.timed_out",
            description="Deferred tasks timed out by the reaper (no trigger ran), by queue"
        )
        self.watcher_restarts = m.create_counter(
            "triggerflow.airflow.watcher_restarts",
            description="Airflow asset-watcher triggers started again, by reason",
        )
        self.resume_hold = m.create_histogram(
            "triggerflow.airflow.resume_hold", unit="s",
            description="How long an Airflow event that requeues its task was held for the "
                        "scheduler race, by what released it",
            explicit_bucket_boundaries_advisory=(0.1, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30),
        )
        self.unconsumed = m.create_counter(
            "triggerflow.queues.unconsumed",
            description="Reaper sweeps that found a queue with no live consumer",
        )
        # Exported at 0 from the start: Prometheus' increase() cannot see a series' first
        # sample as an increase, so a counter born at 1 would hide the first lease loss from
        # the alerts (deploy/prometheus/alerts.yaml). Labelled counters cannot be: their
        # alerts also count a series born within the window (`x unless x offset 1h`).
        self.leases_lost.add(0)

    def gauge(self, name: str, description: str, observe: Observe) -> None:
        """Observe ``name`` through ``observe`` (called on each collection, in the exporter's
        thread). Registering a name again replaces its source: an instrument is created once
        per process, as the SDK would ignore a second one with the same name."""
        with self._gauge_lock:
            known = name in self._gauges
            self._gauges[name] = observe
        if known:
            return

        def callback(_options: CallbackOptions) -> Iterable[Observation]:
            try:
                return [Observation(value, attrs) for value, attrs in self._gauges[name]()]
            except Exception:  # a gauge must never break a scrape
                log.exception("gauge %s failed", name)
                return []

        meter.create_observable_gauge(name, callbacks=[callback], description=description)


_metrics: Metrics | None = None


def get_metrics() -> Metrics:
    global _metrics
    if _metrics is None:
        _metrics = Metrics()
    return _metrics


# ----------------------------------------------------------------------------- setup

_setup_lock = threading.Lock()
_configured = False


def setup(
    *, service: str, metrics_port: int = 0, otlp_endpoint: str | None = None,
    trace_file: str | None = None,
) -> None:
    """Install meter and tracer providers once per process (idempotent: later calls return).

    Instruments already made through ``get_metrics()`` keep working: they were created on
    the API's proxy meter, which binds them to the provider installed here.
    """
    global _configured
    with _setup_lock:
        if _configured:
            return
        _configured = True
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": service})
    readers: list[MetricReader] = []
    if metrics_port:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers.append(PrometheusMetricReader())
    if otlp_endpoint:
        readers.append(_otlp_metric_reader(otlp_endpoint))
    if readers:
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
    if metrics_port:
        from triggerflow import health

        try:  # /metrics beside the probes' /livez and /readyz
            health.serve(metrics_port)
        except OSError as exc:
            raise RuntimeError(f"cannot serve metrics on port {metrics_port}: {exc}") from exc
    if trace_file or otlp_endpoint:
        provider = TracerProvider(resource=resource)
        if trace_file:
            # A local file is cheap to write: flush often so a trace is readable within a second.
            provider.add_span_processor(
                BatchSpanProcessor(JsonLinesSpanExporter(trace_file), schedule_delay_millis=500)
            )
        if otlp_endpoint:
            provider.add_span_processor(BatchSpanProcessor(_otlp_span_exporter(otlp_endpoint)))
        trace.set_tracer_provider(provider)


def _otlp_metric_reader(endpoint: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    except ImportError as exc:
        raise RuntimeError(
            "otlp_endpoint needs opentelemetry-exporter-otlp-proto-http installed"
        ) from exc
    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics"))


def _otlp_span_exporter(endpoint: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise RuntimeError(
            "otlp_endpoint needs opentelemetry-exporter-otlp-proto-http installed"
        ) from exc
    return OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()
    mprovider = metrics.get_meter_provider()
    if hasattr(mprovider, "shutdown"):
        mprovider.shutdown()


def tracing_enabled() -> bool:
    return type(trace.get_tracer_provider()).__name__ == "TracerProvider"


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent")


def context_from(traceparent: str | None) -> Context | None:
    if not traceparent:
        return None
    return _propagator.extract({"traceparent": traceparent})


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object a line (no collector needed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            lines.append(json.dumps({
                "name": span.name,
                "trace_id": f"{ctx.trace_id:032x}",
                "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
                "start": span.start_time, "end": span.end_time,
                "attributes": dict(span.attributes or {}),
                "service": span.resource.attributes.get("service.name"),
            }))
        with self._lock, open(self.path, "a") as fh:
            fh.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
