"""The suite's own services: not the machine's, set up as the tests and the bench need, and
a killed run's leftovers cleaned up by the next."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import pytest

from testbed.services import reap_leftovers
from tests.conftest import SuiteServices


async def test_own_services_are_not_the_machines(services: SuiteServices) -> None:
    own = services.owned()
    assert urlsplit(services.pg).port not in (None, 5432)
    assert urlsplit(services.amqp).port not in (None, 5672)
    assert own.root.is_dir() and str(os.getpid()) in own.root.name
    conn = await asyncpg.connect(f"{services.pg}/postgres")
    try:
        assert "pg_stat_statements" in await conn.fetchval("SHOW shared_preload_libraries")
        assert await conn.fetchval("SHOW data_directory") == str(own.postgres.data)
    finally:
        await conn.close()
    parts = urlsplit(services.management)
    async with httpx.AsyncClient(auth=(parts.username or "", parts.password or "")) as http:
        overview = (await http.get(f"http://{parts.hostname}:{parts.port}/api/overview")).json()
    assert overview["node"] == own.rabbit.nodename
    listeners = {(x["protocol"], x["port"]) for x in overview["listeners"]}
    assert ("amqp", own.rabbit.amqp_port) in listeners


def test_leftovers_of_dead_runs_are_removed(tmp_path: Path) -> None:
    dead = tmp_path / "999999999-abc123"  # no such pid
    (dead / "postgres").mkdir(parents=True)
    alive = tmp_path / f"{os.getpid()}-def456"
    alive.mkdir()
    unrelated = tmp_path / "notes"
    unrelated.mkdir()
    assert reap_leftovers(tmp_path) == [dead]
    assert not dead.exists() and alive.is_dir() and unrelated.is_dir()


def test_env_overrides_mean_no_restarts() -> None:
    overridden = SuiteServices("postgresql://elsewhere", "amqp://elsewhere", "http://x", None)
    with pytest.raises(pytest.skip.Exception):
        overridden.restart_postgres()
