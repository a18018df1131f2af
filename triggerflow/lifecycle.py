"""How a process runs its named tasks: started together, watched until ``stop`` or until one
ends on its own (logged), then cancelled in the order the process chooses; the tasks it runs
beside them; and the single line a process exits with when the broker or the database
refused its credentials."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Collection, Coroutine, Iterable
from types import TracebackType
from typing import Any, TypeVar

from triggerflow.refusals import ACCESS_ATTEMPTS
from triggerflow.store import StoreAccessRefused
from triggerflow.transport import AccessRefused

log = logging.getLogger(__name__)
T = TypeVar("T")


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


async def before_stop(work: Awaitable[T], stop: asyncio.Event,
                      name: str | None = None) -> asyncio.Task[T] | None:
    """Run ``work`` until it ends (its task, done) or ``stop`` is set first (cancelled: None)."""
    task = asyncio.ensure_future(work)
    if name is not None:
        task.set_name(name)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not task.done():
        task.cancel()
        return None
    return task


class Tasks:
    """A process's named tasks. :meth:`until` watches them; leaving an ``async with`` block
    (or :meth:`cancel`) cancels them and waits until they are gone."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []

    def start(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def until(self, stop: asyncio.Event) -> bool:
        """Wait for ``stop`` or for a task to end on its own; True (logged) when one did."""
        stopper = asyncio.get_running_loop().create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stopper, *self.tasks],
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
        return report_stopped(t for t in done if t is not stopper)

    async def cancel(self, *, keep: Collection[str] = (),
                     also: Iterable[asyncio.Future[Any]] = ()) -> None:
        """Cancel every task not named in ``keep`` (and ``also``), and wait until they end."""
        ending: list[asyncio.Future[Any]] = [t for t in self.tasks if t.get_name() not in keep]
        ending.extend(also)
        for task in ending:
            task.cancel()
        await asyncio.gather(*ending, return_exceptions=True)

    async def __aenter__(self) -> Tasks:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.cancel()


class Background:
    """Short tasks spawned beside the named ones, each referenced until it ends (the loop
    keeps only weak references: an unreferenced task can be collected mid-flight); a
    failure is logged, when ``log_failures`` (else left to whoever awaits the task)."""

    def __init__(self, *, log_failures: bool = True) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.log_failures = log_failures

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if self.log_failures and not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def running(self, name: str) -> bool:
        return any(t.get_name() == name for t in self.tasks)

    async def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the tasks running now to end."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)
