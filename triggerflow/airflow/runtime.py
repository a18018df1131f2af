"""The trigger runtime Airflow gives triggers, inside ``consume --airflow``: the
``SUPERVISOR_COMMS`` that trigger code calls (``BaseHook.get_connection``, ``Variable.get``,
``RuntimeTaskInstance.get_dr_count``, ``mask_secret``, the asset state store ...), answered by
``runtime_server`` in a child process, as Airflow's triggerer supervisor answers its runner.

The calling side is Airflow's own ``TriggerCommsDecoder`` (the one its trigger runner installs),
so both call styles behave as under ``airflow triggerer``: a sync call from inside a trigger's
coroutine goes through the greenback portal ``loader.AirflowCoroutine`` opens, a call from
another thread (``sync_to_async``) is bridged onto the loop; neither blocks the loop. Two
things are added:

- fairness: each trigger has at most ``REQUESTS_PER_TRIGGER`` requests in flight (the trigger
  is the ``CURRENT_TRIGGER`` context variable, inherited by its tasks and by
  ``sync_to_async`` threads), so one that floods waits behind itself, not others;
- a lost runtime process fails the requests in flight with ``RuntimeUnavailable`` (not a
  cancellation the trigger would take for its own) and is started again;
- a warm-up: ``RuntimeProcess.ready`` is set once the child has answered one request
  (Airflow imported, its in-process API built, a database connection open: about 5 s). The
  consumer takes nothing before that while a peer serves its queues (``Consumer``'s
  ``warm_up``), so joining a fleet does not make triggers wait for a cold child.

Secrets Airflow masks (connection passwords and extras, variables, ``mask_secret``) are
masked in the consumer's own log output too (``mask_logs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from airflow.jobs.triggerer_job_runner import TriggerCommsDecoder
from airflow.sdk._shared.secrets_masker import SecretsMasker, _secrets_masker
from airflow.sdk.execution_time import task_runner
from airflow.sdk.execution_time.comms import GetDRCount

from triggerflow.errors import TriggerflowError
from triggerflow.lifecycle import Tasks

log = logging.getLogger(__name__)

REQUESTS_PER_TRIGGER = 1
RESTART_DELAY = 1.0  # seconds before a lost runtime process is started again
WARM_UP_TIMEOUT = 60.0  # seconds before a runtime that does not answer counts as ready anyway
# The warm-up's request: a count on the database alone (no secrets backend is asked).
WARM_UP = GetDRCount(dag_id="__triggerflow_warm_up__")
CURRENT_TRIGGER: ContextVar[int | None] = ContextVar("triggerflow_airflow_trigger", default=None)


class RuntimeUnavailable(TriggerflowError, RuntimeError):
    """The runtime process ended while this request was in flight."""


class PerTrigger:
    """At most ``limit`` requests in flight per trigger; a trigger's state lives only while it
    has requests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots: dict[int | None, asyncio.Semaphore] = {}
        self._users: Counter[int | None] = Counter()

    @contextlib.asynccontextmanager
    async def slot(self, trigger_id: int | None) -> AsyncIterator[None]:
        semaphore = self._slots.setdefault(trigger_id, asyncio.Semaphore(self.limit))
        self._users[trigger_id] += 1
        try:
            async with semaphore:
                yield
        finally:
            self._users[trigger_id] -= 1
            if not self._users[trigger_id]:
                del self._users[trigger_id], self._slots[trigger_id]


class RuntimeComms(TriggerCommsDecoder):
    """Airflow's ``TriggerCommsDecoder`` with a per-trigger bound and a clear error when the
    runtime process is lost (Airflow's cancels the pending futures)."""

    def __init__(self, *, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 sock: socket.socket, limit: int = REQUESTS_PER_TRIGGER) -> None:
        super().__init__(async_reader=reader, async_writer=writer, socket=sock)
        self.per_trigger = PerTrigger(limit)

    async def asend(self, msg: Any) -> Any:
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            return await super().asend(msg)  # bridges to this method on the consumer's loop
        async with self.per_trigger.slot(CURRENT_TRIGGER.get()):
            if self.lost:
                raise RuntimeUnavailable(f"Airflow runtime process is not running: {msg.type}")
            try:
                return await super().asend(msg)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self.lost and task is not None and not task.cancelling():
                    raise RuntimeUnavailable(
                        f"Airflow runtime process ended while answering {msg.type}") from None
                raise

    @property
    def lost(self) -> bool:
        return self._reader_task is None or self._reader_task.done()


def mask_logs() -> None:
    """Airflow's secrets masker on the consumer's log handlers (a handler filter sees every
    record that reaches it, whichever logger it came from), switched on as ``airflow
    triggerer`` switches it on."""
    SecretsMasker.enable_log_masking()
    masker = _secrets_masker()
    for handler in logging.getLogger().handlers:
        if masker not in handler.filters:
            handler.addFilter(masker)


class RuntimeProcess:
    """One ``runtime_server`` child and the ``RuntimeComms`` talking to it, installed as
    ``task_runner.SUPERVISOR_COMMS``; started again if it exits while serving."""

    def __init__(self) -> None:
        self.process: asyncio.subprocess.Process | None = None
        self.comms: RuntimeComms | None = None
        self.ready = asyncio.Event()  # the child answered once (or failed to, or timed out)

    async def start(self) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "_AIRFLOW_PROCESS_CONTEXT": "server"}
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "triggerflow.airflow.runtime_server", str(theirs.fileno()),
            pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL)
        theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        self.comms = RuntimeComms(reader=reader, writer=writer, sock=ours)
        await self.comms.start_reader()
        # The trigger runner installs its TriggerCommsDecoder here too (typed for the task runner).
        task_runner.SUPERVISOR_COMMS = self.comms  # type: ignore[assignment]

    async def warm_up(self) -> None:
        """Set ``ready`` once the child answers a request, or after ``WARM_UP_TIMEOUT``: a
        child that fails or is slow only delays the requests, as before."""
        assert self.comms is not None
        started = time.monotonic()
        try:
            await asyncio.wait_for(self.comms.asend(WARM_UP), WARM_UP_TIMEOUT)
        except Exception as exc:
            log.warning("Airflow runtime did not answer its warm-up (%r); serving anyway", exc)
        else:
            log.info("Airflow runtime answering (%.1f s after it started)",
                     time.monotonic() - started)
        finally:
            self.ready.set()

    async def stop(self) -> None:
        if self.comms is not None:
            self.comms._async_writer.close()  # EOF: the child finishes what it has and exits
            if self.comms._reader_task is not None:
                self.comms._reader_task.cancel()
        if self.process is not None and self.process.returncode is None:
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()

    async def supervise(self) -> None:
        while True:
            assert self.process is not None
            code = await self.process.wait()
            log.error("Airflow runtime process exited (%s); starting it again", code)
            await self.stop()
            await asyncio.sleep(RESTART_DELAY)
            await self.start()


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[RuntimeProcess]:
    """The runtime for the consumer's lifetime: ``SUPERVISOR_COMMS`` installed, logs masked;
    entered at once, ``ready`` set in the background once the child answers."""
    context = os.environ.get("_AIRFLOW_PROCESS_CONTEXT")
    os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "client"  # as Airflow's trigger runner sets it
    mask_logs()
    runtime = RuntimeProcess()
    await runtime.start()
    try:
        async with Tasks() as watch:
            watch.start("airflow-runtime", runtime.supervise())
            watch.start("airflow-runtime-warm-up", runtime.warm_up())
            yield runtime
    finally:
        await runtime.stop()
        with contextlib.suppress(AttributeError):
            del task_runner.SUPERVISOR_COMMS
        if context is None:
            os.environ.pop("_AIRFLOW_PROCESS_CONTEXT", None)
        else:
            os.environ["_AIRFLOW_PROCESS_CONTEXT"] = context
