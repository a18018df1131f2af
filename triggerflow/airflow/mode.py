"""Airflow mode: the native loops on ``AirflowStore``, plus what Airflow's triggerer did that
nothing else in the deployment does (``triggerflow.modes`` says what a mode owns).

A consumer runs Airflow's classes (``loader.AirflowLoader``: heap timers for
``DateTimeTrigger`` forms, Airflow's coroutine otherwise), encodes every event with Airflow's
serialisers (``codec.wire_outcome``) and serves the runtime trigger code calls
(``runtime.serving``: connections, variables, XComs, DAG-run and task states ...).

A writer's backstop is scoped to ``queues`` when given (during a migration the other queues
are Airflow's own triggerer's), and beside it run
- the ``TriggererJob`` heartbeat (``heartbeat.triggerer_job``), so Airflow's health checks see
  a triggerer while a writer runs;
- LISTEN on the NOTIFY trigger ``setup`` installed: each new Airflow trigger row becomes a
  wake-up on its team queue within milliseconds (``wakeups.listen``);
- the backstop: every ``reaper_interval``, rows nobody claimed within ``unclaimed_grace`` (a
  notification lost while no listener was connected, a wake-up the broker refused) are sent
  again, and ``Trigger.clean_unused`` runs (Airflow's triggerer runs it every loop);
- task rows with no queue (``start_from_trigger``: the scheduler writes them) get their
  task's queue (``adopt``), on their notification and in the backstop.

The queue gauges read triggerflow's schema and Airflow's rows (``statements.QUEUE_GAUGES``).
Importing this module imports nothing from Airflow; a consumer's loader and encoder do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

import asyncpg

from triggerflow.airflow import cancels
from triggerflow.airflow.adopt import adopt
from triggerflow.airflow.store import AirflowStore
from triggerflow.lifecycle import Tasks
from triggerflow.reaper import Reaper
from triggerflow.settings import Settings
from triggerflow.store import Capabilities, StoreError
from triggerflow.transport import Transport, TransportError

if TYPE_CHECKING:
    from triggerflow.consumer.outcomes import EncodeFn
    from triggerflow.loader import Loader
    from triggerflow.store import SdkStore
    from triggerflow.store.gauges import GaugeSource
    from triggerflow.store.postgres.admin import StatusStatements

log = logging.getLogger(__name__)


class WakeUps:
    """New Airflow trigger rows -> wake-ups on their queues, then marked published (so the
    backstop leaves them alone for ``unclaimed_grace``). ``queues``, when given, are the only
    queues triggerflow serves: rows of any other are Airflow's own triggerer's."""

    def __init__(self, store: AirflowStore, transport: Transport,
                 queues: Sequence[str] = ()) -> None:
        self.store = store
        self.transport = transport
        self.queues = frozenset(queues)

    async def deliver(self, queue: str | None, ids: list[int]) -> None:
        if queue is None and ids:
            ids = await self.adopt(ids)
        queue = queue or self.store.default_queue
        if queue is None or not ids or (self.queues and queue not in self.queues):
            return  # not triggerflow's queue: Airflow's own triggerer serves these rows
        await self._publish(queue, ids)

    async def adopt(self, ids: list[int] | None) -> list[int]:
        """Task rows with no queue (``start_from_trigger``) get their task's queue and are
        woken up there (``adopt``); returns the ``ids`` left without a queue."""
        try:
            adopted = await adopt(self.store.pool, ids, sorted(self.queues))
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("rows with no queue not adopted: %r", exc)  # the backstop tries again
            return ids or []
        for queue, taken in adopted.items():
            await self._publish(queue, taken)
        done = {i for taken in adopted.values() for i in taken}
        return [i for i in ids or () if i not in done]

    async def _publish(self, queue: str, ids: list[int]) -> None:
        try:
            await self.transport.publish_wakeups({queue: ids})
        except TransportError as exc:
            # The backstop re-sends them once the broker (or the queue) is back.
            log.warning("wake-up for %d trigger(s) of %s not sent: %r", len(ids), queue, exc)
            return
        with contextlib.suppress(Exception):
            await self.store.mark_published(ids)


async def backstop(store: AirflowStore, reaper: Reaper, transport: Transport,
                   interval: float, wake: WakeUps) -> None:
    while True:
        await asyncio.sleep(interval)
        if not transport.is_open:
            continue
        try:
            await wake.adopt(None)  # rows with no queue a notification did not bring
            await reaper.resend_unclaimed()
            await store.clean_unused()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("Airflow backstop scan failed: %r", exc)


class AirflowMode:
    """Airflow mode (``settings.airflow``): Airflow's metadata database is the store."""

    name = "airflow"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.writer_queues = list(settings.queues)
        # A task leaving its trigger is signalled (LISTEN on the cancel log); Airflow's
        # scheduler times deferrals out; a consumer may serve one Airflow team.
        self.capabilities = Capabilities(cancel_signal=self._watch_cancels,
                                         times_out_orphans=False, teams=True)

    def _watch_cancels(self, wake: Callable[[], None]) -> AbstractAsyncContextManager[None]:
        return cancels.watch(self.settings.database_dsn(), wake)

    async def connect_store(self, *, max_size: int | None = None,
                            lock_timeout: float | None = None,
                            consumer: bool = False) -> AirflowStore:
        settings = self.settings
        # A consumer takes only its Airflow team's rows, as `airflow triggerer [--team-name]`
        # does under [core] multi_team; the writer routes and re-sends every team's.
        return await AirflowStore.connect(settings.database_dsn(),
                                          default_queue=settings.default_queue,
                                          max_size=max_size or settings.db_pool_size,
                                          lock_timeout=lock_timeout,
                                          resume_delay=settings.airflow_resume_delay.total_seconds(),
                                          consumer=consumer, team=settings.airflow_team)

    async def connect_deferrals(self, *, max_size: int | None = None) -> SdkStore:
        # AirflowStore has no DeferralStore role: Airflow's API server defers and cancels.
        raise StoreError("in Airflow mode tasks defer, and are cleared or marked, through "
                         "Airflow, not triggerflow's SDK")

    def loader(self) -> Loader:
        from triggerflow.airflow.loader import AirflowLoader

        return AirflowLoader(self.settings.allowed_modules, with_task=True)

    def encoder(self) -> EncodeFn | None:
        from triggerflow.airflow.codec import wire_outcome

        return wire_outcome

    @contextlib.asynccontextmanager
    async def serving_consumer(self) -> AsyncIterator[asyncio.Event | None]:
        from triggerflow.airflow import runtime, task_context, trigger_logs
        from triggerflow.airflow.persisted import PENDING
        from triggerflow.airflow.watchers import shared_streams
        from triggerflow.airflow.witness import WITNESS

        dsn = self.settings.database_dsn()
        grace = self.settings.airflow_exit_grace.total_seconds()
        await asyncio.to_thread(task_context.prepare_orm)  # before any trigger's thread
        async with runtime.serving() as served, \
                PENDING.serving(dsn, lambda seqs: shared_streams().confirm_persisted(seqs)), \
                WITNESS.serving(dsn, grace):  # the scheduler race's (loader.AirflowCoroutine)
            # After the runtime: its secrets masker is on before any line is captured.
            with trigger_logs.writing(dsn):
                yield served.ready

    @contextlib.asynccontextmanager
    async def serving_writer(self, store: AirflowStore, transport: Transport, reaper: Reaper,
                             stop: asyncio.Event) -> AsyncIterator[None]:
        from triggerflow.airflow import heartbeat, liveness, wakeups

        settings = self.settings
        wake = WakeUps(store, transport, self.writer_queues)
        interval = settings.reaper_interval.total_seconds()
        # The heartbeat says "healthy" only while the queues with deferred work have consumers.
        beat = liveness.served_beat(settings.default_queue, self.writer_queues)
        async with heartbeat.triggerer_job(store.pool, stamp=beat), Tasks() as side:
            side.start("airflow-listen", wakeups.listen(settings.database_dsn(), wake.deliver, stop))
            side.start("airflow-backstop", backstop(store, reaper, transport, interval, wake))
            yield

    def status_statements(self) -> StatusStatements:
        from triggerflow.airflow.statements import status as sql
        from triggerflow.airflow.statements.unserved import STATUS_UNSERVED, rendered
        from triggerflow.store.postgres.admin import StatusStatements as Statements

        default = self.settings.default_queue
        # A row may wait one lease period unserved: a starting consumer, or Airflow's own
        # triggerer during a migration, takes it within that.
        return Statements(sql.CONSUMERS, sql.WRITERS, sql.QUEUES, sql.OVERDUE,
                                sql.QUARANTINED, sql.HEALTH, queue_args=(default, list(self.settings.queues)),
                                quarantined_args=(default,), unserved=rendered(STATUS_UNSERVED),
                                unserved_args=(default, self.settings.lease_ttl.total_seconds()))

    async def connect_gauges(self) -> GaugeSource:
        from triggerflow.airflow.statements import gauges as sql
        from triggerflow.store.postgres.gauges import SqlGauges

        return await SqlGauges.connect(self.settings.database_dsn(),
                                       leases_sql=sql.QUEUE_GAUGES, queues_sql=sql.GAUGE_QUEUES,
                                       args=[self.settings.default_queue])


if TYPE_CHECKING:
    from triggerflow.modes import Mode

    def _is_a_mode(mode: AirflowMode) -> Mode[AirflowStore]:
        return mode  # mypy checks AirflowMode against the Protocol here
