"""The contract suite's one fixture: ``backend``, a store under test with its seeder, once per
store (memory, native PostgreSQL, Airflow). Every case in this package runs against each.

A case skips a store only where the store roles let that store differ, and says so."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from tests.conftest import admin_sql, drop_database_sql
from tests.contract.backends import Backend, MemoryBackend, NativeBackend

try:  # the Airflow store's cases need triggerflow[airflow]; the others run without it
    from tests import airflow_support
    from tests.airflow_support import airflow_template
except pytest.skip.Exception:
    airflow_support = None  # type: ignore[assignment]

__all__ = ["airflow_template"]

STORES = ["memory", "postgres", "airflow"]


@pytest.fixture(params=STORES)
def store_kind(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(store, database template): the session fixtures that migrate a template run here,
    outside the event loop (they call asyncio.run)."""
    kind: str = request.param
    if kind == "postgres":
        return kind, request.getfixturevalue("template_db")
    if kind == "airflow":
        if airflow_support is None:
            pytest.skip("the Airflow store needs triggerflow[airflow]")
        return kind, request.getfixturevalue("airflow_template")
    return kind, None


@pytest.fixture
async def backend(store_kind: tuple[str, str | None],
                  request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    kind, template = store_kind
    if kind == "memory":
        memory = MemoryBackend()
        yield memory
        await memory.close()
        return
    assert template is not None
    server: str = request.getfixturevalue("pg_server")
    database = f"tf_contract_{uuid.uuid4().hex[:12]}"
    await admin_sql(server, f'CREATE DATABASE "{database}" TEMPLATE "{template}"')
    opened: Backend
    if kind == "postgres":
        opened = await NativeBackend.open(f"{server}/{database}")
    else:
        from tests.contract.airflow_backend import AirflowBackend

        opened = await AirflowBackend.open(database)
    try:
        yield opened
    finally:
        await opened.close()
        await asyncio.shield(admin_sql(server, drop_database_sql(database)))


def only(backend: Backend, *names: str, why: str) -> None:
    """Skip a case on the stores the store roles let differ here, with the reason."""
    if backend.name not in names:
        pytest.skip(f"{backend.name}: {why}")
