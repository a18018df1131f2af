"""The trigger runtime of ``consume --airflow`` (``triggerflow/airflow/runtime.py`` and
``runtime_server.py``), in process against a real Airflow 3.3.2 database: trigger code reads
connections and variables stored in Airflow's database, asks for DAG-run and task states,
sets XComs, as it does under ``airflow triggerer``; a missing id raises what Airflow raises; a
flood from one trigger does not hold another's request; a database outage or a lost runtime
process fails the request, not the consumer."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from tests.airflow_support import (
    DAG_ID,
    RUN_ID,
    airflow_db,
    airflow_env,
    airflow_minor,
    airflow_template,
    dsn_of,
    prepare,
    sqlalchemy_url,
)
from tests.conftest import admin_sql
from tests.test_airflow_consumer import fire
from triggerflow.model import EventKind

__all__ = ["airflow_db", "airflow_template"]

CONN_ID, VARIABLE = "tf_runtime_db_conn", "tf_runtime_variable"
PASSWORD = "s3cret-in-airflows-db"
SEED = f"""
from airflow.models.connection import Connection
from airflow.models.variable import Variable
from airflow.utils.session import create_session
with create_session() as session:
    session.add(Connection(conn_id={CONN_ID!r}, conn_type="http", host="api.example",
                           login="svc", password={PASSWORD!r}))
Variable.set({VARIABLE!r}, "from the metastore")
"""


@pytest.fixture
async def airflow_runtime(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A migrated Airflow database with a DAG run, a Connection and a Variable stored in it
    (not in the environment), and the runtime ``consume --airflow`` starts, pointed at it."""
    from triggerflow.airflow import runtime

    await prepare(dsn_of(airflow_db))
    env = {**os.environ, **airflow_env(airflow_db)}
    subprocess.run([sys.executable, "-c", SEED], env=env, check=True, timeout=120,
                   capture_output=True)
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", sqlalchemy_url(airflow_db))
    monkeypatch.setenv("AIRFLOW__WORKERS__EXECUTION_API_RETRIES", "2")  # the outage test
    monkeypatch.setenv("AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX", "1")
    async with runtime.serving() as process:
        yield process


def payload_of(body: Any) -> Any:
    from airflow.sdk.serde import deserialize

    return deserialize(body)


@pytest.mark.parametrize("style", ["sync", "sync_to_async", "connection_get"])
async def test_a_trigger_reads_a_connection_and_a_variable_stored_in_airflow(
        airflow_runtime: Any, style: str) -> None:
    from tests.airflow_triggers import RuntimeReadingTrigger

    kind, body = await fire(RuntimeReadingTrigger(CONN_ID, VARIABLE, style), timeout=60)
    assert kind is EventKind.RESUME, body
    assert payload_of(body) == {"login": "svc", "password": PASSWORD, "host": "api.example",
                                "variable": "from the metastore"}


@pytest.mark.parametrize(("conn_id", "variable", "raised"), [
    ("tf_no_such_conn", VARIABLE,
     "airflow.sdk.exceptions.AirflowNotFoundException: The conn_id `tf_no_such_conn` isn't defined"),
    (CONN_ID, "tf_no_such_variable",
     "airflow.sdk.exceptions.AirflowRuntimeError: VARIABLE_NOT_FOUND: "
     "{'message': 'Variable tf_no_such_variable not found'}"),
])
async def test_a_missing_id_raises_what_airflow_raises(
        airflow_runtime: Any, conn_id: str, variable: str, raised: str) -> None:
    from tests.airflow_triggers import RuntimeReadingTrigger

    kind, body = await fire(RuntimeReadingTrigger(conn_id, variable, "sync_to_async"),
                            timeout=60)
    assert kind is EventKind.FAIL
    assert body["traceback"][-1].strip() == raised, body["traceback"][-3:]


async def test_dag_run_task_xcom_and_variable_requests_answer_from_airflows_tables(
        airflow_runtime: Any, airflow_db: str) -> None:
    """Through ``SUPERVISOR_COMMS`` as Airflow's SDK sends them (``RuntimeTaskInstance``
    methods in ``sync_to_async``, messages with ``asend``); answers checked against the rows."""
    from airflow.sdk.execution_time import comms as m
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from asgiref.sync import sync_to_async

    from tests.airflow_support import add_deferred_task

    conn = await asyncpg.connect(dsn_of(airflow_db))
    try:
        await add_deferred_task(conn, "waits", "tests.airflow_triggers.RaisingTrigger", "{}")
    finally:
        await conn.close()
    supervisor = airflow_runtime.comms
    assert await sync_to_async(RuntimeTaskInstance.get_dr_count)(
        dag_id=DAG_ID, run_ids=[RUN_ID], states=["running"]) == 1
    assert await sync_to_async(RuntimeTaskInstance.get_dagrun_state)(DAG_ID, RUN_ID) == "running"
    assert await sync_to_async(RuntimeTaskInstance.get_ti_count)(
        dag_id=DAG_ID, task_ids=["waits"], run_ids=[RUN_ID], states=["deferred"]) == 1
    assert await sync_to_async(RuntimeTaskInstance.get_task_states)(
        dag_id=DAG_ID, task_ids=["waits"], run_ids=[RUN_ID]) == {RUN_ID: {"waits": "deferred"}}

    xcom = {"dag_id": DAG_ID, "run_id": RUN_ID, "task_id": "waits", "key": "k"}
    assert await supervisor.asend(m.SetXCom(**xcom, value={"a": 1})) is None
    got = await supervisor.asend(m.GetXCom(**xcom))
    assert (type(got).__name__, got.value) == ("XComResult", {"a": 1})
    await supervisor.asend(m.DeleteXCom(**xcom, map_index=-1))
    assert (await supervisor.asend(m.GetXCom(**xcom))).value is None

    await supervisor.asend(m.PutVariable(key="tf_put", value="v1", description=None))
    assert (await supervisor.asend(m.GetVariable(key="tf_put"))).value == "v1"
    if hasattr(m, "GetVariableKeys"):  # Airflow 3.3's request; 3.2 has none
        keys = await supervisor.asend(m.GetVariableKeys(prefix="tf_"))
        assert sorted(keys.keys) == ["tf_put", VARIABLE]
    await supervisor.asend(m.DeleteVariable(key="tf_put"))
    gone = await supervisor.asend(m.GetVariable(key="tf_put"))
    assert (type(gone).__name__, gone.error.value) == ("ErrorResponse", "VARIABLE_NOT_FOUND")


async def test_secrets_airflow_masks_are_masked_in_the_consumers_logs(
        airflow_runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    from airflow.sdk import BaseHook
    from asgiref.sync import sync_to_async

    from triggerflow.airflow.runtime import mask_logs

    mask_logs()  # caplog's handler came after the fixture's runtime started
    conn = await sync_to_async(BaseHook.get_connection)(CONN_ID)
    logging.getLogger("triggerflow.consumer").warning("trigger said %s", conn.password)
    assert PASSWORD not in caplog.text
    assert "trigger said ***" in caplog.text


async def test_a_flooding_trigger_does_not_hold_another_triggers_request(
        airflow_runtime: Any) -> None:
    """Trigger 1 sends 200 requests at once; trigger 2 sends one after them. With the
    per-trigger bound, trigger 2's answer comes while nearly all of the flood still waits
    (without it, behind the 200 in the runtime's queue)."""
    from airflow.sdk.execution_time.comms import GetVariable

    from triggerflow.airflow.runtime import CURRENT_TRIGGER

    supervisor = airflow_runtime.comms
    answered: list[int] = []

    async def ask(trigger_id: int) -> None:
        CURRENT_TRIGGER.set(trigger_id)
        await supervisor.asend(GetVariable(key=VARIABLE))
        answered.append(trigger_id)

    await ask(0)  # the runtime is warm
    flood = [asyncio.create_task(ask(1)) for _ in range(200)]
    await asyncio.sleep(0)  # every flood request is waiting or sent before the lone one
    await ask(2)
    flood_done_before = answered.count(1)
    await asyncio.gather(*flood)
    assert answered.count(1) == 200
    assert flood_done_before <= 10, f"{flood_done_before} flood answers came first"


async def test_a_database_outage_fails_the_request_as_airflow_does_then_answers_again(
        airflow_runtime: Any, airflow_db: str, pg_server: str) -> None:
    """Airflow's secrets chain skips a backend that raises, so a variable read in an outage
    is ``VARIABLE_NOT_FOUND`` (the runtime logs why); a request the execution API answers
    from the database itself fails with ``API_SERVER_ERROR`` after Airflow's retries."""
    from airflow.sdk import Variable
    from airflow.sdk.exceptions import AirflowRuntimeError
    from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
    from asgiref.sync import sync_to_async

    get = sync_to_async(Variable.get)
    count = sync_to_async(RuntimeTaskInstance.get_dr_count)
    assert await get(VARIABLE) == "from the metastore"
    await admin_sql(pg_server, f'ALTER DATABASE "{airflow_db}" ALLOW_CONNECTIONS false',
                    f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    f"WHERE datname = '{airflow_db}'")
    try:
        with pytest.raises(AirflowRuntimeError) as raised:
            await get(VARIABLE)
        assert raised.value.error.error.value == "VARIABLE_NOT_FOUND"
        with pytest.raises(AirflowRuntimeError) as raised:
            await count(dag_id=DAG_ID, run_ids=[RUN_ID])
        assert raised.value.error.error.value == "API_SERVER_ERROR"
        detail = raised.value.error.detail
        assert detail["status_code"] == 500
        if airflow_minor() != "3.2":  # 3.2's API server names no reason: "Internal server error"
            assert detail["detail"]["detail"]["reason"] == "Database error"
    finally:
        await admin_sql(pg_server, f'ALTER DATABASE "{airflow_db}" ALLOW_CONNECTIONS true')
    assert await get(VARIABLE) == "from the metastore"
    assert await count(dag_id=DAG_ID, run_ids=[RUN_ID]) == 1


async def test_a_lost_runtime_process_fails_requests_and_is_started_again(
        airflow_runtime: Any) -> None:
    from airflow.sdk.execution_time.comms import GetVariable

    from triggerflow.airflow.runtime import RuntimeUnavailable

    before = airflow_runtime.comms
    assert (await before.asend(GetVariable(key=VARIABLE))).value == "from the metastore"
    airflow_runtime.process.kill()
    await airflow_runtime.process.wait()
    with pytest.raises(RuntimeUnavailable):
        await before.asend(GetVariable(key=VARIABLE))
    for _ in range(300):
        if airflow_runtime.comms is not before and not airflow_runtime.comms.lost:
            break
        await asyncio.sleep(0.1)
    answer = await airflow_runtime.comms.asend(GetVariable(key=VARIABLE))
    assert answer.value == "from the metastore"


async def test_ready_is_set_once_the_runtime_answers_and_a_dead_one_only_delays_it(
        airflow_runtime: Any, caplog: pytest.LogCaptureFixture) -> None:
    """``ready`` (the consumer's ``warm_up``) is set by the first answer; a child that cannot
    answer is logged and counts as ready all the same (its requests fail as before)."""
    caplog.set_level(logging.INFO, logger="triggerflow.airflow.runtime")
    async with asyncio.timeout(60):
        await airflow_runtime.ready.wait()
    assert "Airflow runtime answering" in caplog.text
    airflow_runtime.ready.clear()
    airflow_runtime.process.kill()
    await airflow_runtime.process.wait()
    await airflow_runtime.warm_up()  # returns: the warm-up never stops the consumer
    assert airflow_runtime.ready.is_set()
    assert "did not answer its warm-up (RuntimeUnavailable(" in caplog.text
