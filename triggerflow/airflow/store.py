"""``AirflowStore``: the store's serving roles (``ServingStore``) on an Airflow 3.3 database.

Leases and bookkeeping live in triggerflow's schema; triggers, task instances and XComs are
Airflow's rows, read as Airflow stores them and written as Airflow's own functions write them
(``events``). What differs from the native store:

* a trigger's queue is Airflow's ``trigger.queue`` (the deferring task's queue, with
  ``[triggerer] queues_enabled``); rows without one belong to ``default_queue`` or, when that
  is None, to nobody here (Airflow's own triggerer keeps serving them);
* claimed kwargs are decoded by Airflow's code (``kwargs.decode_kwargs``) with the Fernet key
  of Airflow's configuration; event bodies arrive already encoded by Airflow's serialisers
  (``codec``), so the writer needs no Airflow import;
* a consumer of an Airflow team (``team_scope``, ``teams.py``) touches only rows of its team,
  as ``airflow triggerer --team-name`` does under ``[core] multi_team``;
* deferral, cancellation and trigger timeouts are Airflow's (API server, scheduler): it
  serves every role but ``DeferralStore`` (``store.roles``), and ``time_out_orphans`` does
  nothing; a task that leaves its trigger is read from the cancel log (``cancels``),
  promptly: the mode's ``Capabilities.cancel_signal`` wakes the sweep (LISTEN).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from triggerflow.airflow import cancels
from triggerflow.airflow.applying import apply_batch, with_airflow
from triggerflow.airflow.events import CLEAN_UNUSED, AirflowEvent
from triggerflow.airflow.nontask import GONE_WATCHERS
from triggerflow.airflow.setup import check_airflow_schema
from triggerflow.airflow.statements import claims, reaper
from triggerflow.airflow.statements.lease import LEASE
from triggerflow.airflow.teams import TeamScope, has_teams, render, scope_for
from triggerflow.airflow.unused import UnusedTriggers
from triggerflow.store import (
    MAX_BLOCKS,
    Applied,
    ClaimResult,
    FreedTrigger,
    KwargsError,
    KwargsProblem,
    ProcessKind,
    Reaped,
    Struck,
    Taker,
    TriggerRef,
    TriggerSpec,
)
from triggerflow.store.postgres.base import SqlStore, scope
from triggerflow.store.postgres.pool import (
    DATA_ERRORS,
    keep_session,
    session_settings,
    store_errors,
)
from triggerflow.wire import Event

log = logging.getLogger(__name__)

# Bad content in an event body (not JSON, wrong JSON type, nested too deep): refused.
_REFUSED = DATA_ERRORS
_DECODE_INLINE = 64  # claimed rows decoded on the loop; more go to a thread


class AirflowStore(SqlStore):
    """The store on one pool over Airflow's database (``dsn``; Airflow's own code, for the
    events it applies, opens its own connections to it).

    ``default_queue`` serves Airflow trigger rows that have no queue; None leaves them to
    Airflow's own triggerer. ``team_scope``: the Airflow team filter of a consumer under
    ``[core] multi_team`` (``teams.scope_for``); None, no filter (a writer, or multi_team off).
    """

    def __init__(self, pool: asyncpg.Pool, dsn: str, default_queue: str | None = None,
                 resume_delay: float = 0.0, release: str = "3.3",
                 team_scope: TeamScope | None = None) -> None:
        # Renewals share the pool here (no lease_dsn): an Airflow consumer holds 1,000s.
        super().__init__(pool, LEASE, refused=_REFUSED)
        self.default_queue = default_queue
        self.resume_delay = resume_delay  # the scheduler race's hold (loader.AirflowCoroutine)
        self.dsn = dsn  # for the events Airflow's own code applies (orm.py)
        self.airflow_release = release  # the Airflow minor whose schema this is (events.APPLY_FOR)
        self.team_scope = team_scope
        self.team = team_scope.team if team_scope else None  # the statements' team parameter
        self._rendered: dict[str, str] = {}  # statement -> its team markers written out
        # Applied batches' trigger rows, deleted after the burst (see unused.py).
        self._applying = 0  # batches in _apply now
        self.unused = UnusedTriggers(self._clean_unused_of, busy=lambda: self._applying > 0)
        self.lock_timeout: float | None = None  # the writer's, on every pooled session
        # The writer's housekeeping (see _housekeeping): one session without lock_timeout.
        self.housekeeping: asyncpg.Pool | None = None
        # Non-task rows (asset watchers, callbacks) this consumer claimed: id -> attempt.
        # They run until stopped, so the cancel sweep also looks for their bookkeeping
        # having gone (deleted with the row by the writer's clean-up).
        self.watchers: dict[int, int] = {}
        self.cancel_log = cancels.CancelLog()

    @classmethod
    async def connect(cls, dsn: str, *, default_queue: str | None = None,
                      max_size: int = 4, lock_timeout: float | None = None,
                      resume_delay: float = 0.0, consumer: bool = False,
                      team: str | None = None) -> AirflowStore:
        """A ``consumer``'s store filters by Airflow team (``team``: its ``--team``) as
        ``teams.scope_for`` says, and raises ``TeamRefused`` for a team Airflow refuses."""
        async with store_errors(_REFUSED):
            pool = await _pool(dsn, max_size, "triggerflow-airflow", lock_timeout)
        housekeeping = None
        scope = None
        try:
            async with pool.acquire() as conn:
                release = await check_airflow_schema(conn)
                if consumer:
                    scope = await scope_for(conn, team, release)
            if lock_timeout is not None:
                async with store_errors(_REFUSED):
                    housekeeping = await _pool(dsn, 1, "triggerflow-airflow-housekeeping")
        except BaseException:
            await pool.close()
            raise
        store = cls(pool, dsn, default_queue, resume_delay, release, scope)
        if scope is not None:
            log.info("[core] multi_team is on: serving only trigger rows of %s",
                     f"Airflow team {scope.team}" if scope.team else "no Airflow team")
        store.lock_timeout = lock_timeout
        store.housekeeping = housekeeping
        return store

    async def close(self) -> None:
        await self.unused.close()
        if self.housekeeping is not None:
            with contextlib.suppress(TimeoutError):
                await self.housekeeping.close()
        await super().close()

    def _spec(self, row: asyncpg.Record) -> TriggerSpec:
        from cryptography.fernet import InvalidToken

        from triggerflow.airflow.kwargs import decode_kwargs

        kwargs: dict[str, Any] | None = None
        problem: KwargsError | None = None
        try:
            kwargs = decode_kwargs(row["kwargs"], row["classpath"])
        except InvalidToken as exc:  # another process may hold the right Fernet key
            problem = KwargsError(KwargsProblem.UNREADABLE_HERE,
                                  f"kwargs not readable with this Fernet key: {exc!r}")
        except Exception as exc:
            problem = KwargsError(KwargsProblem.INVALID, repr(exc))
        # A deferral younger than the hold: its event waits for the rest of it (this
        # process's clock from here on; the age was measured on the database's).
        young = self.resume_delay - (row["deferred_for"] or 0.0)
        if row["task"] is None:
            self.watchers[row["id"]] = row["attempt"]
        return TriggerSpec(row["id"], row["attempt"], sys.intern(row["queue"]),
                           sys.intern(row["classpath"]), kwargs, problem, row["task"],
                           not_before=time.time() + young if young > 0 else None)

    def _sql(self, statement: str) -> str:
        """``statement`` with its team markers written out for this store (``teams.render``);
        keyed by text, so a statement replaced at run time (tools/mutate_sql.py) is rendered
        afresh."""
        rendered = self._rendered.get(statement)
        if rendered is None:
            rendered = self._rendered[statement] = render(
                statement, scoped=self.team_scope is not None,
                has_teams=has_teams(self.airflow_release))
        return rendered

    # -- lease -----------------------------------------------------------------------------

    async def register(self, kind: ProcessKind, host: str, pid: int, queues: Sequence[str],
                       capacity: int, version: str, ttl: float) -> int:
        """The lease row, with the team filter this process applies (status, the heartbeat
        and the gauges read who serves a team from it)."""
        row = await self._fetchrow(self._lease.register, str(kind), host, pid, list(queues),
                                   capacity, version, ttl, self.team,
                                   self.team_scope is not None)
        assert row is not None
        return int(row["id"])

    # -- consumer ------------------------------------------------------------------------

    async def claim(self, me: int, ids: Sequence[int], queues: Sequence[str]) -> ClaimResult:
        result = ClaimResult()
        if not ids:
            return result
        claimed: list[asyncpg.Record] = []
        for row in await self._fetch(self._sql(claims.CLAIM), me, list(ids), list(queues),
                                     self.default_queue, self.team):
            if row["outcome"] == "claimed":
                claimed.append(row)
            elif row["outcome"] == "suspect":
                result.suspects.append(row["id"])
            elif row["outcome"] == "elsewhere":
                result.elsewhere.append(TriggerRef(row["id"], row["queue"]))
            else:
                result.refused.append(TriggerRef(row["id"], row["queue"]))
        result.claimed.extend(await self._specs(claimed))
        return result

    async def _specs(self, rows: list[asyncpg.Record]) -> list[TriggerSpec]:
        """Decode claimed rows; a big claim in a thread. Fernet and Airflow's serde cost
        ~50 us a row on the loop: 10,000 at once stalled renewals past the lease."""
        if len(rows) < _DECODE_INLINE:
            return [self._spec(r) for r in rows]
        return await asyncio.to_thread(lambda: [self._spec(r) for r in rows])

    async def claim_probation(self, me: int, queues: Sequence[str],
                              limit: int | None = None) -> list[TriggerSpec]:
        rows = await self._fetch(self._sql(claims.CLAIM_PROBATION), me, list(queues),
                                 limit or 2**31 - 1, self.default_queue, self.team)
        return await self._specs(list(rows))

    async def clear_probation(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(claims.CLEAR_PROBATION, me, list(ids))

    async def release(self, me: int, ids: Sequence[int] | None = None, *,
                      cannot_load: bool = False, reason: str | None = None) -> list[TriggerRef]:
        rows = await self._fetch(claims.RELEASE, me, None if ids is None else list(ids),
                                 cannot_load, reason, self.default_queue)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def release_lost(self, me: int, ids: Sequence[int],
                           attempts: Sequence[int]) -> list[TriggerRef]:
        rows = await self._fetch(claims.RELEASE_LOST, me, list(ids), list(attempts),
                                 self.default_queue)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def taken_since(self, me: int, seconds: float) -> list[tuple[int, int]]:
        return [(r["id"], r["attempt"]) for r in await self._fetch(claims.TAKEN_SINCE, me, seconds)]

    async def fail_unloadable(self, me: int, ids: Sequence[int]) -> list[int]:
        rows = await self._fetch(self._sql(claims.FAIL_UNLOADABLE), list(ids), me,
                                 self.default_queue)
        return [r["id"] for r in rows]

    async def other_loaders(self, trigger_id: int, me: int) -> int:
        rows = await self._fetch(self._sql(claims.OTHER_LOADERS), trigger_id, me,
                                 self.default_queue)
        return int(rows[0]["count"]) if rows else 0

    async def forget(self, me: int, ids: Sequence[int]) -> None:
        await self._execute(claims.FORGET_HELD, list(ids), me)

    async def sweep_cancelled(self, me: int) -> list[int]:
        """Triggers whose task left them since the last call (``cancels``): a superset of
        what ``me`` runs, as the log is not keyed by owner; the consumer stops those it runs
        and ``forget`` drops their bookkeeping, if the writer has not already. Non-task rows
        (watchers) held here are stopped once their row or its watch is gone."""
        ids = await self.cancel_log.read(self._fetch)
        if self.watchers:
            held = list(self.watchers.items())
            gone = [r["id"] for r in await self._fetch(
                GONE_WATCHERS, me, [i for i, _ in held], [a for _, a in held])]
            for trigger_id in gone:
                self.watchers.pop(trigger_id, None)
            ids += gone
        return ids

    async def strike(self, me: int, trigger_id: int, attempt: int, blocked: float,
                     max_blocks: int, queues: Sequence[str]) -> Struck | None:
        rows = await self._fetch(claims.STRIKE, me, trigger_id, attempt, blocked, max_blocks,
                                 list(queues), self.default_queue)
        return next((Struck(r["id"], r["queue"], r["classpath"], r["blocks"], r["quarantined"],
                            r["freed"]) for r in rows), None)

    # -- writer --------------------------------------------------------------------------

    async def apply_events(self, events: Sequence[Event]) -> list[Applied]:
        """``Event.payload`` is the body ``codec`` encoded (see ``events.AirflowEvent``)."""
        applied, _ = await self._apply(events, skip_held=False)
        return applied

    async def apply_unlocked(self, events: Sequence[Event]) -> tuple[list[Applied], list[Event]]:
        return await self._apply(events, skip_held=True)

    async def _apply(self, events: Sequence[Event],
                     skip_held: bool) -> tuple[list[Applied], list[Event]]:
        batch = [AirflowEvent(e.trigger_id, e.attempt, e.queue, e.kind, e.payload, e.fired_at)
                 for e in events]
        self._applying += 1
        try:
            async with self._errors(), self.pool.acquire() as conn:
                done = await apply_batch(conn, batch, default_queue=self.default_queue,
                                         release=self.airflow_release, skip_held=skip_held)
        finally:
            self._applying -= 1
        self.unused.add(e.trigger_id for e in batch if e.trigger_id not in done.held)
        applied = [Applied(r["kind"], r["queue"], r["latency"]) for r in done.rows]
        applied += await with_airflow(done, self.dsn, self.default_queue)
        return applied, [e for e in events if e.trigger_id in done.held]

    # -- reaper ----------------------------------------------------------------------------

    async def reap_dead(self, queues: Sequence[str] | None, max_failures: int,
                        limit: int | None = None, taker: Taker | None = None,
                        max_blocks: int = MAX_BLOCKS) -> Reaped:
        # One statement for all they held (an Airflow consumer holds 1,000s, not a million:
        # no batches, unless asked); what the taker may run is its own in the same rewrite.
        if taker is not None and queues is None:
            raise ValueError("a taker reaps only its own queues")
        rows = await self._fetch(self._sql(reaper.REAP_DEAD), *scope(queues), max_failures,
                                 limit or 2**31 - 1, taker and taker.me,
                                 taker.room if taker else 0, max_blocks, self.default_queue,
                                 self.team)
        freed = [FreedTrigger(r["id"], r["queue"], r["classpath"], r["failures"],
                              r["quarantined"]) for r in rows if not r["taken"]]
        taken = await self._specs([r for r in rows if r["taken"]])
        return Reaped(freed, rows[0]["dead"] if rows else 0, taken)

    async def resend_unclaimed(self, queues: Sequence[str] | None, grace: float,
                               limit: int) -> list[TriggerRef]:
        rows = await self._fetch_waiting(self._sql(reaper.RESEND_UNCLAIMED), *scope(queues), grace,
                                         limit, self.default_queue, self.team)
        return [TriggerRef(r["id"], r["queue"]) for r in rows]

    async def mark_published(self, ids: Sequence[int]) -> None:
        """Wake-ups sent for these rows (by the NOTIFY listener): the backstop skips them."""
        await self._fetch_waiting(reaper.MARK_PUBLISHED, list(ids))

    async def time_out_orphans(self, queues: Sequence[str] | None,
                               max_deferral: float) -> list[TriggerRef]:
        return []  # Airflow's scheduler times deferred tasks out (check_trigger_timeouts)

    def _housekeeping(self) -> asyncpg.Pool:
        """Where housekeeping off the hot path runs: it waits for row locks as before. The
        writer's ``lock_timeout`` is for its batches, which must not wait behind a team's
        locks (the backstop's re-send, failing on a burst's row locks, also skipped its
        clean); its own session without one costs no statement per call, where ``SET LOCAL
        lock_timeout = 0`` cost three (BEGIN, SET, COMMIT) every few seconds of an idle
        writer's."""
        return self.housekeeping or self.pool

    async def _fetch_waiting(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """``_fetch`` for housekeeping (``_housekeeping``)."""
        async with self._errors(), self._housekeeping().acquire() as conn:
            rows: list[asyncpg.Record] = await conn.fetch(query, *args)
            return rows

    async def _clean_unused_of(self, ids: list[int]) -> None:
        await self._fetch_waiting(CLEAN_UNUSED, ids)

    async def clean_unused(self) -> int:
        """``Trigger.clean_unused``, whole-table; returns how many trigger rows went."""
        # Two statements, no transaction around them: each is right on its own (a detached
        # task stays detached; the delete reads what references a row when it runs, and
        # new deferrals make new rows), and BEGIN/COMMIT were a third of an idle writer's
        # backstop statements.
        async with self._errors(), self._housekeeping().acquire() as conn:
            await conn.execute(reaper.DETACH_FINISHED)
            return int(await conn.fetchval(reaper.DELETE_UNUSED))

    async def waiting_queues(self, grace: float) -> list[str]:
        return [r["queue"] for r in await self._fetch(reaper.WAITING_QUEUES, grace,
                                                      self.default_queue)]

    async def queue_consumers(self, queues: Sequence[str]) -> dict[str, int]:
        rows = await self._fetch(reaper.QUEUE_CONSUMERS, list(queues))
        return {r["q"]: int(r["consumers"]) for r in rows}


async def _pool(dsn: str, max_size: int, name: str,
                lock_timeout: float | None = None) -> asyncpg.Pool:
    # keep_session: without it asyncpg's reset query is four more statements after every call
    # (measured: 5 statements/s per idle process instead of 1). ORIGIN: the cancel log's row
    # triggers skip triggerflow's own moves.
    return await asyncpg.create_pool(
        dsn, min_size=1, max_size=max_size, reset=keep_session,
        server_settings={**session_settings(name, lock_timeout=lock_timeout), **cancels.ORIGIN})


if TYPE_CHECKING:
    from triggerflow.store import ServingStore

    def _is_a_store(store: AirflowStore) -> ServingStore:
        return store  # mypy checks AirflowStore against the roles it serves here
