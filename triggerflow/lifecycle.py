"""How a loop's named tasks end: the log of one that stopped on its own, and the single line
a process exits with when the broker or the database refused its credentials."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from triggerflow.refusals import ACCESS_ATTEMPTS
from triggerflow.store import StoreAccessRefused
from triggerflow.transport import AccessRefused

log = logging.getLogger(__name__)


def refused_line(exc: BaseException) -> str | None:
    """The exit line for a refusal that ended the process, or None for any other error."""
    if isinstance(exc, AccessRefused):
        service, setting, what = "the broker", "TRIGGERFLOW_AMQP_URL", "virtual host"
    elif isinstance(exc, StoreAccessRefused):
        service, setting, what = "the database", "TRIGGERFLOW_DATABASE_URL", "database"
    else:
        return None
    hint = "; a missing database: `triggerflow db upgrade` creates it" \
        if what == "database" else ""
    return (f"exiting: {service} refused our credentials {ACCESS_ATTEMPTS} times in a row "
            f"({exc}); check the user, password and {what} in {setting}{hint}")


def report_refused(exc: BaseException) -> bool:
    """Log the exit line if ``exc`` is a refusal of our credentials; True when it was."""
    line = refused_line(exc)
    if line is not None:
        log.error("%s", line)  # the cause is known: no traceback
    return line is not None


def report_stopped(tasks: Iterable[asyncio.Task[Any]]) -> bool:
    """Log each lifecycle task that ended on its own; True when there was one."""
    stopped = list(tasks)
    for task in stopped:
        exc = None if task.cancelled() else task.exception()
        if exc is None or not report_refused(exc):
            log.error("task %s stopped unexpectedly; shutting down", task.get_name(),
                      exc_info=exc)
    return bool(stopped)
