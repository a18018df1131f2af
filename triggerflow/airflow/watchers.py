"""Trigger rows with no deferred task: asset watchers and callback triggers.

Airflow 3.3.2's triggerer runs such a row (``trigger.assets`` or ``trigger.callback`` set,
``trigger.queue`` NULL, so only a triggerer without ``--queues`` takes it) like any other,
but differently on three points, each matched here:

* every event the trigger yields goes to ``Trigger.submit_event``, not only the first: for
  each asset the row watches ``AssetManager.register_asset_change`` records an asset event
  (``extra = {"from_trigger": True, "payload": ...}``) and queues the DAG runs it schedules;
  a callback row's ``Callback.handle_event`` records the callback's state and output;
* the trigger keeps running after an event; when its ``run()`` ends or raises, the row is
  still assigned to the triggerer, so its next loop (about a second later) builds and starts
  the trigger again from the row (``TriggerRunnerSupervisor.update_triggers``); a failure
  fails no task (``submit_failure`` finds none);
* it stops when the row goes: the DAG no longer declares the watcher (dag-processor), or the
  callback reached a terminal state, and ``clean_unused`` deletes the row.

Watchers that share I/O (Airflow 3.3's ``BaseEventTrigger.shared_stream_key``, e.g.
``DirectoryFileDeleteTrigger``s on one directory) share it here too: one
``open_shared_stream`` poll per key and consumer, driven by Airflow's own
``SharedStreamManager``, each trigger reading it through its ``filter_shared_stream``. A
stream in ack mode (the trigger overrides ``create_shared_stream_producer``) acks a message
only once the events derived from it are committed; the writer commits them, in another
process, and says so through PostgreSQL (``persisted``).

``WatcherCoroutine`` is the consumer's side (``keeps_running``: the runner emits each event
and steps on); ``nontask`` holds the SQL the store uses to claim and keep these rows; the
writer applies their events with Airflow's own ``Trigger.submit_event``
(``orm.apply_watcher_events``). Rows without a queue are triggerflow's only with
``--default-queue``.

Importing this module imports Airflow (through ``codec``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import greenback

from triggerflow.airflow.codec import Encoded, encode_event
from triggerflow.airflow.persisted import PENDING, wire_body
from triggerflow.airflow.runtime import CURRENT_TRIGGER
from triggerflow.loader import AllowedClasses
from triggerflow.store.interface import TriggerSpec
from triggerflow.telemetry import get_metrics
from triggerflow.triggers.base import BaseTrigger, TriggerEvent

log = logging.getLogger(__name__)

# Airflow's triggerer re-creates an ended watcher on its next loop, which waits up to 1 s for
# the runner's messages first (``TriggerRunnerSupervisor.run_once``).
RESTART_DELAY = 1.0
# A callback row's trigger (``TriggererCallback.queue``): its last event is terminal, after
# which Airflow detaches and deletes the row, so it is never started again.
CALLBACK_TRIGGER = "airflow.triggers.callback.CallbackTrigger"


_streams: Any = None  # this consumer's SharedStreamManager, made on first use (its loop)


def shared_streams() -> Any:
    """The process's ``SharedStreamManager``, configured from ``[triggerer]`` as Airflow's
    triggerer configures its own."""
    global _streams
    if _streams is None:
        from airflow.configuration import conf
        from airflow.triggers.shared_stream import SharedStreamManager

        _streams = SharedStreamManager(
            max_subscriber_queue=conf.getint("triggerer", "shared_stream_subscriber_queue_size"),
            ack_timeout=conf.getfloat("triggerer", "shared_stream_ack_timeout"),
            cohort_grace_period=conf.getfloat("triggerer", "shared_stream_cohort_grace_period"))
    return _streams


def shared_key(trigger: Any) -> Hashable | None:
    """The shared stream ``trigger`` reads, or None: it runs its own ``run()``."""
    from airflow.triggers.base import BaseEventTrigger

    # Airflow 3.2's BaseEventTrigger has no shared streams: every trigger runs its own run().
    if not isinstance(trigger, BaseEventTrigger) or not hasattr(trigger, "shared_stream_key"):
        return None
    try:
        return trigger.shared_stream_key()
    except Exception:  # Airflow: logged, and the trigger runs standalone
        log.exception("shared_stream_key() of %s raised; running it on its own",
                      type(trigger).__qualname__)
        return None


def ack_mode(cls: type) -> bool:
    """Whether ``cls`` opts its shared stream into ack mode (as Airflow's manager decides)."""
    from airflow.triggers.base import BaseEventTrigger

    for klass in cls.__mro__:
        if klass is BaseEventTrigger:
            return False
        if "create_shared_stream_producer" in klass.__dict__:
            return True
    return False


class WatcherEvent(TriggerEvent):
    """One event of a watcher row, already in the wire form (serde of the payload)."""

    def __init__(self, body: str) -> None:
        super().__init__(Encoded(body))


class WatcherCoroutine(BaseTrigger):
    """An Airflow trigger of an asset watcher or callback row, run as Airflow's triggerer
    runs it: every event emitted, restarted ``RESTART_DELAY`` after its ``run()`` ends."""

    keeps_running = True

    def __init__(self, build: Callable[[], Any], restart_delay: float | None = RESTART_DELAY,
                 assets_of: Callable[[int], dict[str, str] | None] | None = None) -> None:
        self.build = build  # a fresh Airflow trigger object from the row, as Airflow builds it
        self.restart_delay = restart_delay  # None: run once (a callback's trigger)
        self.current: Any = None
        # Reads the row's watched assets (name to URI) from Airflow's database, for the
        # trigger's asset_state_store (``consume --airflow``; None: not given one).
        self.assets_of = assets_of

    def serialize(self) -> tuple[str, dict[str, Any]]:
        trigger = self.current
        if trigger is None:
            return "triggerflow.airflow.watchers.WatcherCoroutine", {}
        classpath, kwargs = trigger.serialize()
        return str(classpath), dict(kwargs)

    async def _stepping(self) -> None:
        """Each step of this generator after an event runs in a new task of the runner's
        (``TriggerRunner._next_event``), with the runner's context: the trigger's identity
        (``CURRENT_TRIGGER``, the runtime's per-trigger bound) and the greenback portal (sync
        SDK calls from ``run()``: ``Variable.get``, ``asset_state_store.set``) are set again
        in it. Without this a watcher's sync call after its first event raised Airflow's
        "Sync SDK methods ... cannot be called" (found by tests/test_airflow_assets.py)."""
        CURRENT_TRIGGER.set(self.trigger_id)
        if os.environ.get("AIRFLOW_DISABLE_GREENBACK_PORTAL", "").lower() != "true":
            await greenback.ensure_portal()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        await self._stepping()
        while True:
            self.current = trigger = self.build()
            trigger.trigger_id = self.trigger_id
            await self._give_asset_state_store(trigger)
            events = 0
            key = shared_key(trigger)
            acked = key is not None and ack_mode(type(trigger))
            if acked and not await self._listening(trigger):
                continue
            agen = trigger.run() if key is None else trigger.filter_shared_stream(
                shared_streams().subscribe(trigger_id=self.trigger_id, trigger=trigger, key=key))
            reason = "ended"
            try:
                async for event in agen:
                    events += 1
                    _, body = encode_event(event)
                    if acked:  # bound before the event leaves, no await in between
                        self._bind(key, body)
                    yield WatcherEvent(body)
                    await self._stepping()
                log.info("trigger %s (ID %s) ended after %d event(s)",
                         type(trigger).__qualname__, self.trigger_id, events)
            except Exception:
                # Airflow: logged, submit_failure (no task to fail), then started again.
                reason = "raised"
                log.exception("trigger %s (ID %s) raised; starting it again",
                              type(trigger).__qualname__, self.trigger_id)
            finally:
                await agen.aclose()
                await self._stopped(trigger, key, acked)
            if self.restart_delay is None:
                return
            self._restarting(trigger, reason)
            await asyncio.sleep(self.restart_delay)

    @staticmethod
    def _restarting(trigger: Any, reason: str) -> None:
        get_metrics().watcher_restarts.add(1, {"trigger_class": type(trigger).__qualname__,
                                               "reason": reason})

    async def _give_asset_state_store(self, trigger: Any) -> None:
        """``asset_state_store`` for the assets the row watches now, as Airflow's runner sets
        it on an event trigger (``TriggerRunner.create_triggers``, from the workload its
        supervisor builds for each start): read again at each start, so a DAG that changed the
        watcher's assets is followed. Its calls are runtime requests."""
        from airflow.triggers.base import BaseEventTrigger

        if self.assets_of is None or not isinstance(trigger, BaseEventTrigger):
            return
        try:
            from airflow.sdk.execution_time.context import AssetStateStoreAccessors
        except ImportError:  # Airflow 3.2: no asset state store
            return
        try:
            assets = await asyncio.to_thread(self.assets_of, int(self.trigger_id or 0))
        except Exception as exc:  # runs without one (as a row that watches none); next start reads again
            log.warning("trigger %s (ID %s): its watched assets not read (%r); no "
                        "asset_state_store this run", type(trigger).__qualname__,
                        self.trigger_id, exc)
            return
        if assets:
            from airflow.sdk.definitions.asset import Asset

            trigger.asset_state_store = AssetStateStoreAccessors(
                inlets=[Asset(name=name, uri=uri) for name, uri in assets.items()])

    async def _listening(self, trigger: Any) -> bool:
        """LISTEN for the writer's commits before an ack-mode stream's first event (its
        confirmation must not be missed); False, after the restart delay, when the database
        cannot be reached: started again, as after a failure."""
        try:
            await PENDING.listening()
            return True
        except Exception:
            log.exception("trigger %s (ID %s): cannot LISTEN for its events' commits; "
                          "starting it again", type(trigger).__qualname__, self.trigger_id)
            self._restarting(trigger, "listen_failed")
            self.current = None
            await asyncio.sleep(self.restart_delay or RESTART_DELAY)
            return False

    def _bind(self, key: Hashable, body: str) -> None:
        """An ack-mode event's message is acked once the writer says it is committed."""
        seq = shared_streams().bind_pending_event(trigger_id=self.trigger_id, key=key)
        if seq is not None and self.trigger_id is not None:
            PENDING.expect(self.trigger_id, wire_body(body), seq)

    async def _stopped(self, trigger: Any, key: Hashable | None, acked: bool) -> None:
        """One run of ``trigger`` ended: leave its stream, clean it up (as Airflow does)."""
        if acked and self.trigger_id is not None:
            PENDING.forget(self.trigger_id)
        cancelled = False
        if key is not None:
            # Airflow's group.stop() awaits its poll under suppress(CancelledError): a cancel
            # of this task landing there was swallowed, and the watcher started again for
            # good. Shielded, the cancel reaches this task; leaving the stream still ends.
            leaving = asyncio.ensure_future(shared_streams().unsubscribe(self.trigger_id, key))
            try:
                await asyncio.shield(leaving)
            except asyncio.CancelledError:
                cancelled = True
                await asyncio.wait([leaving])
            if not leaving.cancelled() and leaving.exception() is not None:
                log.error("leaving the shared stream %r failed", key,
                          exc_info=leaving.exception())
        try:
            await trigger.cleanup()
        except Exception:
            log.warning("cleanup of %s failed", type(trigger).__qualname__, exc_info=True)
        self.current = None
        if cancelled:
            raise asyncio.CancelledError

    async def cleanup(self) -> None:
        # run()'s own ``finally`` cleaned each trigger it started; nothing is left here.
        return None


def watcher(loader: AllowedClasses, spec: TriggerSpec, first: Any,
            assets_of: Callable[[int], dict[str, str] | None] | None = None) -> WatcherCoroutine:
    """``first`` (built by the loader, so a bad row fails as any other) runs first; each
    restart builds a new object from the row's kwargs, as Airflow's triggerer does (a copy:
    a trigger may change what it was given, as ``CallbackTrigger`` pops ``context``).
    ``assets_of`` reads the row's watched assets (``consume --airflow``)."""
    pristine = copy.deepcopy(spec.kwargs or {})
    built = [first]

    def build() -> Any:
        if built:
            return built.pop()
        return loader.resolve(spec.classpath)(**copy.deepcopy(pristine))

    return WatcherCoroutine(build, None if spec.classpath == CALLBACK_TRIGGER else RESTART_DELAY,
                            assets_of)
