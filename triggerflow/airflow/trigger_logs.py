"""Per-task trigger log files, where Airflow's UI reads a deferred task's trigger logs.

Airflow's triggerer writes what each trigger logs to ``<base_log_folder>/<the task's log file
name>.trigger.<job id>.log`` (``TriggerRunnerSupervisor._create_workload``, JSON lines, one
file per try), and the API server shows every file next to the task's own log: its local read
(``FileTaskHandler._read_from_local``) globs ``<task log file>*``. ``consume --airflow``
writes the same files for the triggers it runs, named ``.trigger.triggerflow-<host>-<pid>.log``
(no Airflow job is ours; the suffix keeps two consumers of one try apart, as Airflow's job id
does).

What is captured: records logged while a trigger's coroutine runs (the ``CURRENT_TRIGGER``
context variable, inherited by its tasks and ``sync_to_async`` threads), both through the
trigger's structlog logger (``self.log``, Airflow's ``LoggingMixin``) and through the standard
``logging`` module, triggerflow's own loggers excepted. Secrets are masked by Airflow's
``SecretsMasker`` before a line is buffered.

Off the hot path: the trigger's side only appends a dict to a bounded buffer (a full buffer
drops the line and counts it); one thread, every ``FLUSH_INTERVAL``, looks up the task
instances of new trigger ids (one query), renders Airflow's ``log_filename_template`` and
appends each trigger's lines to its file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from triggerflow.airflow.runtime import CURRENT_TRIGGER

log = logging.getLogger(__name__)

FLUSH_INTERVAL = 0.5  # seconds between writes; a deferred task's log is read by people
MAX_BUFFERED = 20_000  # lines waiting to be written; beyond it lines are dropped (counted)
MAX_PATHS = 100_000  # trigger ids whose file name is remembered

TASKS_OF = """
SELECT trigger_id, dag_id, task_id, run_id, map_index, try_number
FROM task_instance WHERE trigger_id = ANY(%s)
"""

_STDLIB_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def log_suffix() -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())
    return f"triggerflow-{host}-{os.getpid()}"


class TriggerLogs:
    """The buffer, the file names and the writing thread."""

    def __init__(self, dsn: str, base_folder: str | Path, suffix: str | None = None) -> None:
        self.dsn = dsn
        self.base = Path(base_folder)
        self.suffix = suffix or log_suffix()
        self.buffer: deque[tuple[int, dict[str, Any]]] = deque()
        self.dropped = 0
        self.written = 0
        self.paths: dict[int, Path | None] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Any = None

    # -- the trigger's side: no I/O

    def add(self, trigger_id: int, event: dict[str, Any]) -> None:
        if len(self.buffer) >= MAX_BUFFERED:
            self.dropped += 1
            return
        self.buffer.append((trigger_id, event))

    # -- the writing thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="airflow-trigger-logs", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        if self.dropped:
            log.warning("%d trigger log line(s) dropped (buffer full)", self.dropped)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(FLUSH_INTERVAL)
            self.flush()
        self.flush()

    def flush(self) -> None:
        batch: dict[int, list[dict[str, Any]]] = {}
        while self.buffer:
            trigger_id, event = self.buffer.popleft()
            batch.setdefault(trigger_id, []).append(event)
        if not batch:
            return
        try:
            self._resolve([t for t in batch if t not in self.paths])
        except Exception as exc:  # the database away: these lines wait for the next flush
            log.warning("trigger log files not resolved: %r", exc)
            for trigger_id, events in batch.items():
                self.buffer.extendleft((trigger_id, e) for e in reversed(events))
            return
        for trigger_id, events in batch.items():
            path = self.paths.get(trigger_id)
            if path is None:
                continue  # no deferred task (asset watcher, callback): Airflow writes none
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a", encoding="utf-8") as out:
                    out.writelines(json.dumps(e, default=str) + "\n" for e in events)
                self.written += len(events)
            except OSError as exc:
                log.warning("trigger log %s not written: %r", path, exc)

    def _resolve(self, trigger_ids: list[int]) -> None:
        if not trigger_ids:
            return
        from airflow.utils.helpers import log_filename_template_renderer

        if len(self.paths) > MAX_PATHS:
            self.paths.clear()
        if self._conn is None or self._conn.closed:
            import psycopg2  # type: ignore[import-untyped]

            self._conn = psycopg2.connect(self.dsn)
            self._conn.autocommit = True
        try:
            with self._conn.cursor() as cur:
                cur.execute(TASKS_OF, (trigger_ids,))
                rows = cur.fetchall()
        except Exception:
            self._conn.close()
            raise
        render = log_filename_template_renderer()
        for trigger_id in trigger_ids:
            self.paths[trigger_id] = None
        for trigger_id, dag_id, task_id, run_id, map_index, try_number in rows:
            ti = SimpleNamespace(
                dag_id=dag_id, task_id=task_id, run_id=run_id, map_index=map_index, try_number=try_number
            )
            try:
                name = render(ti=ti, try_number=try_number)
            except Exception as exc:  # a template naming what a task-less row lacks
                log.warning("trigger %d: log file name not rendered: %r", trigger_id, exc)
                continue
            self.paths[trigger_id] = self.base / f"{name}.trigger.{self.suffix}.log"


def _masked(event: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk._shared.secrets_masker import redact

    masked = redact(event)
    return masked if isinstance(masked, dict) else event


class StructlogTap:
    """A structlog processor, placed before the renderer: a copy of each event logged while a
    trigger runs goes to that trigger's file."""

    def __init__(self, sink: TriggerLogs) -> None:
        self.sink = sink

    def __call__(
        self, logger: Any, method: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        trigger_id = CURRENT_TRIGGER.get()
        if trigger_id is not None:
            event = {k: v for k, v in event_dict.items() if k != "loc"}
            event.setdefault("level", method)
            self.sink.add(trigger_id, _masked(event))
        return event_dict


class StdlibTap(logging.Handler):
    """The same for records of the ``logging`` module (provider hooks log through it)."""

    def __init__(self, sink: TriggerLogs) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        trigger_id = CURRENT_TRIGGER.get()
        if trigger_id is None or record.name.startswith("triggerflow"):
            return
        from datetime import UTC, datetime

        event: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
            "logger": record.name,
        }
        event.update((k, v) for k, v in vars(record).items() if k not in _STDLIB_FIELDS)
        if record.exc_info:
            event["error_detail"] = logging.Formatter().formatException(record.exc_info)
        self.sink.add(trigger_id, _masked(event))


@contextlib.contextmanager
def writing(dsn: str, base_folder: str | None = None) -> Iterator[TriggerLogs]:
    """Capture trigger logs into Airflow's per-task files for the consumer's lifetime
    (``[logging] base_log_folder`` unless given)."""
    import structlog

    if base_folder is None:
        from airflow.configuration import conf

        base_folder = conf.get("logging", "base_log_folder")
    sink = TriggerLogs(dsn, base_folder)
    processors = structlog.get_config()["processors"]  # Airflow's list, shared by its loggers
    tap = StructlogTap(sink)
    processors.insert(max(len(processors) - 1, 0), tap)
    handler = StdlibTap(sink)
    logging.getLogger().addHandler(handler)
    sink.start()
    try:
        yield sink
    finally:
        logging.getLogger().removeHandler(handler)
        with contextlib.suppress(ValueError):
            processors.remove(tap)
        sink.stop()
