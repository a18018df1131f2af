"""The asyncpg pool and a thin query helper for the operator commands and the reference host.

The loops never use this directly: they go through :class:`~triggerflow.store.postgres.store.
PostgresStore`, which also owns the translation of driver errors into the store's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg

from triggerflow.store.interface import (
    EventRefused,
    EventsLocked,
    StoreAccessRefused,
    StoreError,
    StoreUnavailable,
)

# asyncpg ships no type information; rows are read as mappings of column name to value.
Record = Mapping[str, Any]

# The connection itself failed (server restarting, socket dropped): worth a retry.
DB_DISCONNECTED: tuple[type[BaseException], ...] = (
    OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError, asyncpg.AdminShutdownError,
    # A transaction's connection lost mid-statement (a server restart): asyncpg's rollback
    # then fails with "cannot switch to state ...; another operation is in progress". Met by
    # the Airflow writer's fault test; unhandled, it ends a writer's apply task.
    asyncpg.InternalClientError,
    # Connected to a standby (a URL without target_session_attrs=read-write that fell back to
    # the next host): it refuses writes until it is promoted, after which the same session
    # writes. Also TargetServerAttributeNotMatched (an InternalClientError above): no host
    # was read-write yet, mid-failover.
    asyncpg.ReadOnlySQLTransactionError,
)

# What an event's content alone makes PostgreSQL reject: invalid data (SQLSTATE class 22), a
# payload nested past the server's limits (class 54: "stack depth limit exceeded" parsing a
# deep jsonb). Such an event is refused and dead-lettered; retried, it would stop every writer.
DATA_ERRORS: tuple[type[BaseException], ...] = (asyncpg.DataError, asyncpg.ProgramLimitExceededError)

# The server refused who we are (password, role, database name): no retry fixes that.
ACCESS_REFUSED: tuple[type[BaseException], ...] = (
    asyncpg.InvalidAuthorizationSpecificationError,  # unknown role, pg_hba refusal, password
    asyncpg.InvalidCatalogNameError,  # no such database
)
REFUSED_CONTENT = (*DATA_ERRORS, asyncpg.IntegrityConstraintViolationError)


@contextlib.asynccontextmanager
async def store_errors(
    refused: tuple[type[BaseException], ...] = REFUSED_CONTENT,
) -> AsyncIterator[None]:
    """Driver errors as the store's own (see :mod:`triggerflow.store.interface`); ``refused``:
    the errors that mean an event's content was refused."""
    try:
        yield
    except DB_DISCONNECTED as exc:
        raise StoreUnavailable(repr(exc)) from exc
    except ACCESS_REFUSED as exc:
        raise StoreAccessRefused(f"{type(exc).__name__}: {exc}") from exc
    except refused as exc:
        raise EventRefused(str(exc)) from exc
    except asyncpg.LockNotAvailableError as exc:  # lock_timeout: another team's row locks
        raise EventsLocked(str(exc)) from exc
    except asyncpg.PostgresError as exc:
        raise StoreError(repr(exc)) from exc


async def keep_session(conn: asyncpg.Connection) -> None:
    """Release without asyncpg's reset query (``SELECT pg_advisory_unlock_all(); CLOSE ALL;
    UNLISTEN *; RESET ALL``): four statements and a round trip after every call. Nothing here
    leaves session state behind; asyncpg still rolls back a transaction left open."""


def session_settings(application_name: str, *, pgbouncer: bool = False,
                     lock_timeout: float | None = None) -> dict[str, str]:
    """Startup parameters of every triggerflow connection.

    ``jit`` off: the row-security predicates make PostgreSQL estimate the reaper's and
    release's statements at 10^5-10^6 (a sequential scan they never run), past
    ``jit_above_cost``, so each call compiled 136 functions: 1.2-1.4 s of JIT for 0.1 ms of
    work (auto_explain in ``bench million`` at 100,000 held). Nothing here runs long enough
    to gain from JIT. PgBouncer refuses startup parameters it does not know, so behind it
    set ``jit = off`` for the roles instead (``ALTER ROLE ... SET jit = off``).

    ``lock_timeout`` (seconds; the writer's): a statement waiting longer for a row lock fails
    with SQLSTATE 55P03 instead of waiting for whoever holds it (a team's own ``FOR UPDATE``).
    Set per session, it costs no statement per batch; behind PgBouncer, on the role.
    """
    settings = {"application_name": application_name}
    if not pgbouncer:
        settings["jit"] = "off"
        if lock_timeout is not None:
            settings["lock_timeout"] = f"{max(1, round(lock_timeout * 1000))}ms"
    return settings


async def create_pool(dsn: str, *, max_size: int = 4, pgbouncer: bool = False,
                      lock_timeout: float | None = None) -> asyncpg.Pool:
    """A bounded pool. Behind PgBouncer (transaction mode) prepared statements are not cached."""
    return await asyncpg.create_pool(
        dsn,
        min_size=1,
        max_size=max_size,
        statement_cache_size=0 if pgbouncer else 256,
        command_timeout=60,
        server_settings=session_settings("triggerflow", pgbouncer=pgbouncer,
                                         lock_timeout=lock_timeout),
        reset=keep_session,
    )


class Database:
    """A pool with ``fetch``/``fetchrow``/``fetchval``/``execute``. One instance per process."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool

    @classmethod
    async def connect(cls, dsn: str, *, max_size: int = 4, pgbouncer: bool = False) -> Database:
        return cls(await create_pool(dsn, max_size=max_size, pgbouncer=pgbouncer))

    async def close(self) -> None:
        await asyncio.wait_for(self.pool.close(), timeout=10)

    async def fetch(self, sql: str, *args: Any) -> list[Record]:
        async with self.pool.acquire() as conn:
            rows: list[Record] = await conn.fetch(sql, *args)
            return rows

    async def fetchrow(self, sql: str, *args: Any) -> Record | None:
        async with self.pool.acquire() as conn:
            row: Record | None = await conn.fetchrow(sql, *args)
            return row

    async def fetchval(self, sql: str, *args: Any) -> Any:
        async with self.pool.acquire() as conn:
            return await conn.fetchval(sql, *args)

    async def execute(self, sql: str, *args: Any) -> str:
        async with self.pool.acquire() as conn:
            status: str = await conn.execute(sql, *args)
            return status
