"""Admission: what a consumer lets in, and the one place its free room is computed.

Every way in passes here: wake-ups delivered by the broker (``deliver``, gathered into claim
batches by ``next_batch``), triggers our own reaper freed or took over (``take_locally``,
``taking``/``adopt``: this is the reaper's :class:`~triggerflow.reaper.Local`) and probation
groups (``room`` under ``lock``). Ids count as pending from the moment they are queued here
until they run or are passed on, so the room left is never promised twice.

``lock`` is the claim lock: claims, take-overs, probation and a strike's first try hold it,
and shutdown takes it for good, so nothing commits a claim after shutdown's release (it
would strand those triggers on our dead row). At capacity, while our clock is off the
database's, or while we warm up beside a peer (``warming``), the subscriptions are
cancelled; they resume with 10% of the room to spare.

After a rebalancing shed, broker deliveries beyond what we kept go on to peers for a short
while (``keep_at_most``): the wake-ups we handed back land on us as often as on the peer we
shed them to, and claimed here again they would undo the shed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from triggerflow.consumer.context import Republish
from triggerflow.lease import Lease
from triggerflow.lifecycle import Background
from triggerflow.runner import TriggerRunner
from triggerflow.settings import Settings
from triggerflow.store import ClaimStore, StoreError, Taker, TriggerSpec
from triggerflow.transport import Delivery, TransportError
from triggerflow.transport.subscriptions import Subscriptions

if TYPE_CHECKING:
    from triggerflow.consumer.context import ConsumerContext

log = logging.getLogger(__name__)

# Trigger ids to claim, and the wake-up that carried them (None: freed by our own reaper).
Wakeup = tuple[list[int], Delivery | None]
# Starts specs a take-over made ours (the consumer's starter, built after admission).
Start = Callable[[list[TriggerSpec]], Awaitable[None]]


async def _not_connected(specs: list[TriggerSpec]) -> None:
    raise RuntimeError("admission has no starter yet (Admission.connect)")


class Admission:
    """Wake-ups waiting to be claimed, the ids pending, the claim lock and the room left.

    ``start`` starts specs a take-over made ours (None: given later, by ``connect``);
    ``republish`` wakes their queues' consumers for what we hand back; ``background`` runs
    what must not hold up the caller. Its state changes by its own methods (``stop``,
    ``clock_checked``, ``decide_warm_up``, ``end_warm_up``, ``claimed``).
    """

    def __init__(
        self,
        settings: Settings,
        store: ClaimStore,
        lease: Lease,
        runner: TriggerRunner,
        subscriptions: Subscriptions,
        background: Background,
        start: Start | None,
        republish: Republish,
    ) -> None:
        self.capacity = settings.capacity
        self.claim_batch = settings.claim_batch
        self.queues = list(settings.queues)
        self.store = store
        self.lease = lease
        self.runner = runner
        self.subscriptions = subscriptions
        self.background = background
        self.start: Start = start or _not_connected
        self.republish = republish
        self.wakeups: asyncio.Queue[Wakeup] = asyncio.Queue()
        self.pending = 0  # delivered ids queued for a claim, not running yet
        self.adopting = 0  # taken over (ours in the store already), starting in the background
        self.lock = asyncio.Lock()
        self.clock_ok: bool | None = None  # None: not compared with the database's yet
        # Our trigger runtime is still starting and a peer serves our queues meanwhile.
        self.warming = False
        self._warm_up_decided = False  # at the first renewal (``decide_warm_up``)
        self.stopping = False  # shutdown began: nothing more is let in
        self.ceiling: int | None = None  # after a shed: deliveries beyond it go on to peers
        self.ceiling_until = 0.0  # ... until then (monotonic)
        # A take that failed may have committed unseen (``doubts``; given by ``connect``).
        self.on_unanswered: Callable[[float], None] = lambda began: None

    @classmethod
    def of(cls, context: ConsumerContext, subscriptions: Subscriptions) -> Admission:
        """The consumer's admission; ``connect`` then gives it the parts built after it."""
        return cls(context.settings, context.store, context.lease, context.runner, subscriptions,
                   context.background, None, context.republish)

    def connect(self, start: Start, unanswered: Callable[[float], None]) -> None:
        """The parts that need admission and are built after it: ``start`` starts what a
        take-over made ours; ``unanswered`` records a take that failed (it may have
        committed unseen)."""
        self.start, self.on_unanswered = start, unanswered

    # -- state -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Shutdown began: nothing more is let in."""
        self.stopping = True

    def clock_checked(self, ok: bool) -> bool:
        """Record a comparison of our clock with the database's; whether the verdict changed
        (the caller stops or resumes what runs on it, then ``update_flow``)."""
        if ok is self.clock_ok:
            return False
        self.clock_ok = ok
        return True

    def serving(self) -> bool:
        """Whether we take triggers (as the lease tells peers): a good clock, not warming up."""
        return self.clock_ok is True and not self.warming

    def is_warming(self) -> bool:
        """Whether we still wait for our trigger runtime beside a peer (read by readiness)."""
        return self.warming

    def decide_warm_up(self, runtime: asyncio.Event | None, live_peers: int) -> None:
        """Once, at the first renewal (which reads the peers): with our runtime still
        starting, wait while a subscribed peer serves our queues (it runs them meanwhile, and
        counts us as capacity only once we subscribe); alone, serve at once, or everything
        would wait, timers included. ``runtime`` None: nothing to wait for."""
        if self._warm_up_decided:
            return
        self._warm_up_decided = True
        if runtime is not None and not runtime.is_set() and live_peers > 0:
            self.warming = True
            log.info("%d peer(s) serve our queues: taking nothing until our trigger runtime "
                     "answers", live_peers)

    async def warmed_up(self, runtime: asyncio.Event) -> None:
        """End the warm-up once ``runtime`` is set."""
        await runtime.wait()
        self.end_warm_up("our trigger runtime is up")

    def peer_gone(self, why: str = "a peer left") -> None:
        """A peer of our queues left or died: the wake-ups a shed handed it are ours again,
        and it may be the one that served our queues while we warm up."""
        self.lift_ceiling()
        self.end_warm_up(why)

    def claimed(self, batch: list[Wakeup]) -> None:
        """A claim batch is done (claimed, passed on or handed back): no longer pending."""
        self.pending -= sum(len(ids) for ids, _ in batch)

    # -- room --------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Triggers running, adopted and pending: what counts against ``capacity``."""
        return len(self.runner) + self.adopting + self.pending

    def room(self, *, counting_pending: bool = True) -> int:
        """Triggers we may still take: none on a skewed clock or while warming up (no
        claim, take-over or probation then). A claim batch's own ids are pending ones: it asks without
        ``counting_pending`` (wake-ups queued behind it are no commitment), but a take-over
        still starting is ours already: counted always, or a claim beside it overshoots
        ``capacity`` by up to a batch (seen in `bench zone`: 42,000 held for 40,000)."""
        if not self.clock_ok or self.warming:
            return 0
        counted = self.held if counting_pending else len(self.runner) + self.adopting
        return max(0, self.capacity - counted)

    def keep_at_most(self, ceiling: int, seconds: float) -> None:
        """For ``seconds``, claim broker deliveries only up to ``ceiling`` triggers held; the
        rest go on to peers. Take-overs and probation are not held to it (a peer dying
        meanwhile is taken over at once)."""
        self.ceiling, self.ceiling_until = ceiling, time.monotonic() + seconds

    def lift_ceiling(self) -> None:
        self.ceiling = None

    def end_warm_up(self, why: str) -> None:
        """Take triggers from now on (``why``: for the log), if we were warming up."""
        if self.warming:
            self.warming = False
            log.info("taking triggers now: %s", why)
            self.update_flow()

    def delivery_room(self) -> int:
        """Room for a claim batch of broker deliveries: ``room`` without the batch's own
        pending ids, within the ceiling a shed set while it lasts."""
        room = self.room(counting_pending=False)
        if self.ceiling is not None:
            if time.monotonic() >= self.ceiling_until:
                self.ceiling = None
            else:
                room = min(room, max(0, self.ceiling - len(self.runner) - self.adopting))
        return room

    def keeps(self, me: int) -> bool:
        """Whether what a claim or take-over under ``me`` took may run here: still our lease
        under that id (not fenced while the statement ran) and still a good clock (peers run
        it otherwise)."""
        return self.lease.holds(me) and bool(self.clock_ok)

    def update_flow(self) -> None:
        """At capacity (or with a skewed clock) cancel the subscriptions; resume with room
        (10% hysteresis) and a good clock."""
        room = self.room()
        paused = self.subscriptions.paused
        if not paused and room == 0:
            if self.clock_ok and not self.warming:
                log.info("at capacity (%d); pausing subscriptions", self.held)
            self.subscriptions.paused = True  # at once: no resume may slip in before the task
            self.background.spawn(self.subscriptions.pause())
        elif paused and room > self.capacity * 0.1:
            log.info("room again (%d held); resuming subscriptions", self.held)
            self.subscriptions.paused = False
            self.background.spawn(self.subscriptions.resume())

    # -- wake-ups ----------------------------------------------------------------------------

    def deliver(self, ids: list[int], message: Delivery | None) -> None:
        self.pending += len(ids)
        self.wakeups.put_nowait((ids, message))

    async def next_batch(self) -> list[Wakeup]:
        """The next wake-up, and those waiting behind it up to ``claim_batch`` ids."""
        batch = [await self.wakeups.get()]
        n = len(batch[0][0])
        while n < self.claim_batch and not self.wakeups.empty():
            item = self.wakeups.get_nowait()
            batch.append(item)
            n += len(item[0])
        return batch

    def fit(self, batch: list[Wakeup]) -> tuple[list[int], dict[str, list[int]]]:
        """Split delivered ids into what fits our free room and the overflow per queue."""
        # skewed: all of it goes on to peers (deliveries in flight as we unsubscribed)
        room = self.delivery_room()
        ids: list[int] = []
        overflow: dict[str, list[int]] = defaultdict(list)
        for msg_ids, message in batch:
            for trigger_id in msg_ids:
                if len(ids) < room:
                    ids.append(trigger_id)
                elif message is not None and message.routing_key:
                    overflow[message.routing_key].append(trigger_id)
        return ids, overflow

    # -- the reaper's side (reaper.Local) ----------------------------------------------------

    @contextlib.asynccontextmanager
    async def taking(self) -> AsyncIterator[Taker | None]:
        """While the reaper takes dead peers' triggers over: no claim, no shutdown's release
        in between (a take-over committed after it would strand them on our dead row)."""
        async with self.lock:
            room = self.room()
            yield (Taker(self.lease.me, room) if room and not self.stopping and self.lease.valid() else None)

    async def adopt(self, taker: Taker, specs: list[TriggerSpec]) -> None:
        if not self.keeps(taker.me):
            # Fenced while the take-over ran: nobody runs what it took under the old id.
            # (Or our clock went wrong meanwhile: peers run it.)
            with contextlib.suppress(StoreError, TransportError):  # else the reaper's later
                await self.republish(await self.store.release(taker.me, [s.id for s in specs]))
            return
        # Started while the reaper's next batch is rewritten (the database works meanwhile);
        # counted until then, so the next batch and any claim leave room for them.
        self.adopting += len(specs)
        self.background.spawn(self._start_adopted(specs))

    async def _start_adopted(self, specs: list[TriggerSpec]) -> None:
        try:
            await self.start(specs)
        finally:
            self.adopting -= len(specs)

    def unanswered(self, began: float) -> None:
        """A claim, take-over or probation claim begun at ``began`` (loop time) failed."""
        self.on_unanswered(began)

    def take_locally(self, queue: str, ids: list[int]) -> list[int]:
        """Queue freed triggers for our own claim loop; return what does not fit."""
        if queue not in self.queues or self.stopping:
            return ids
        room = self.room()
        take, rest = ids[:room], ids[room:]
        for i in range(0, len(take), self.claim_batch):
            self.deliver(take[i : i + self.claim_batch], None)
        return rest


async def requeue_all(batch: list[Wakeup]) -> None:
    for _, message in batch:
        if message is None:
            continue  # freed by our reaper: its next pass re-sends what stays unclaimed
        try:
            await message.reject(requeue=True)
        except TransportError:
            log.debug("reject lost with the channel; the broker requeues it anyway")


async def ack_all(batch: list[Wakeup]) -> None:
    for _, message in batch:
        if message is None:
            continue  # taken locally from the reaper, not delivered
        try:
            await message.ack()
        except TransportError:
            # Redelivered after the reconnect; the claim then finds us the owner and
            # changes nothing.
            log.debug("ack lost with the channel")
