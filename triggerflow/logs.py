"""Structured logging that stays off the hot path.

Lifecycle lines are DEBUG (one per step, guarded by ``isEnabledFor`` so a 10k burst at INFO
formats nothing); failures are WARNING. Every record can carry ``trigger_id``, ``task`` and
``queue``; the JSON formatter writes them as fields, so one task's history is one grep.
"""

from __future__ import annotations

import json
import logging
import sys
import time

CONTEXT_FIELDS = ("trigger_id", "task", "queue", "attempt", "consumer_id", "trigger_class")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for field in CONTEXT_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                data[field] = value
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return json.dumps(data, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s%(context)s")

    def format(self, record: logging.LogRecord) -> str:
        parts = [f"{f}={getattr(record, f)}" for f in CONTEXT_FIELDS if getattr(record, f, None)]
        record.context = (" [" + " ".join(parts) + "]") if parts else ""
        return super().format(record)


FORMATTERS: dict[str, type[logging.Formatter]] = {"text": TextFormatter, "json": JsonFormatter}


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Root logging at ``level`` in format ``fmt`` (``text``/``json``, any case; another is an
    error, never a silent fallback)."""
    if fmt.lower() not in FORMATTERS:
        raise ValueError(f"log format {fmt!r}: use text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(FORMATTERS[fmt.lower()]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet_client_libraries(root.level)


def quiet_client_libraries(level: int) -> None:
    """The AMQP client and asyncio log at WARNING or above; aiormq's ERROR for each failed
    connect only at DEBUG, since the caller reports that failure itself (one line, or a
    retry warning) and the two would say it twice."""
    for noisy in ("aio_pika", "aiormq", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, level))
    logging.getLogger("aiormq.connection").setLevel(
        logging.DEBUG if level <= logging.DEBUG else logging.CRITICAL)
