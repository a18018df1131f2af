"""What a trigger's ``BaseHook.get_connection`` / ``Variable.get`` answer under Airflow 3.3's
``[core] multi_team``, in process on a real Airflow 3.3.2 database: the same as Airflow's own
triggerer answers, and never another team's secret.

Airflow 3.3.2's triggerer answers trigger code through its in-process execution API
(``InProcessExecutionAPI``), which overrides the JWT dependency with a token for the zero
task-instance id (``always_allow`` in ``api_fastapi/execution_api/app.py``): the routes'
``get_team_name_dep`` resolves no team for it, and ``Connection``/``Variable`` lookups with
``team_name=None`` read only values of no team (the metastore's ``team_name IS NULL``, the
environment's ``AIRFLOW_CONN_<ID>`` and never ``AIRFLOW_CONN__<TEAM>___<ID>``). Each request
below goes to triggerflow's runtime child (``runtime_server``) and, in a process of its own set
up as the triggerer's supervisor is, to ``TriggerRunnerSupervisor._handle_request`` on a client
over ``in_process_api_server()``; the answers must be equal. A trigger of ALPHA runs through
the consumer's whole path too (the trigger side's secrets chain, then the child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests import airflow_support as af
from tests.airflow_support import airflow_3_3_only, airflow_db, airflow_template
from tests.test_airflow_consumer import fire
from triggerflow.model import EventKind

__all__ = ["airflow_db", "airflow_template"]

pytestmark = airflow_3_3_only  # teams on connections, variables and trigger rows are 3.3's

ALPHA, BETA = "alpha_team", "beta_team"
SHARED = "tf_shared_conn"  # the same conn_id for ALPHA, for BETA and of no team
GLOBAL_VAR, BETA_VAR = "tf_global_var", "tf_beta_var"
BETA_CONN, GLOBAL_DB_CONN = "tf_beta_conn", "tf_global_db_conn"
BETAS_SECRETS = ["beta-password", "beta.example", "beta-db-password", "beta's secret"]


def uri(login: str) -> str:
    return f"http://{login}:{login}-password@{login}.example:8080"


# AIRFLOW_CONN_<ID> is of no team, AIRFLOW_CONN__<TEAM>___<ID> of that team (Airflow's
# EnvironmentVariablesBackend), in the consumer's and its runtime child's environment alike.
ENVIRONMENT = {
    "AIRFLOW__CORE__MULTI_TEAM": "True",
    f"AIRFLOW_CONN_{SHARED.upper()}": uri("global"),
    f"AIRFLOW_CONN__{ALPHA.upper()}___{SHARED.upper()}": uri("alpha"),
    f"AIRFLOW_CONN__{BETA.upper()}___{SHARED.upper()}": uri("beta"),
}
SEED = f"""
from airflow.models.connection import Connection
from airflow.models.variable import Variable
from airflow.utils.session import create_session
with create_session() as session:
    session.add(Connection(conn_id={BETA_CONN!r}, conn_type="http", host="beta.example",
                           login="beta-db", password="beta-db-password", team_name={BETA!r}))
    session.add(Connection(conn_id={GLOBAL_DB_CONN!r}, conn_type="http", host="db.example",
                           login="global-db", password="global-db-password"))
Variable.set({BETA_VAR!r}, "beta's secret", team_name={BETA!r})
Variable.set({GLOBAL_VAR!r}, "everyone's")
"""
# Airflow's own answer: TriggerRunnerSupervisor._handle_request on the triggerer's client
# (TriggerRunnerSupervisor.start builds it so), in a server-context process as the triggerer
# supervisor runs; writes each answer as JSON to the file named second.
AIRFLOW_ANSWERS = """
import json, os, sys
os.environ["_AIRFLOW_PROCESS_CONTEXT"] = "server"
import structlog
from airflow.jobs.triggerer_job_runner import TriggerRunnerSupervisor, in_process_api_server
from airflow.sdk.api.client import Client
from airflow.sdk.execution_time.comms import GetConnection, GetVariable, GetVariableKeys

class Supervisor:  # what _handle_request reads of the supervisor, and its reply
    def __init__(self):
        self.client = Client(base_url=None, token="", dry_run=True,
                             transport=in_process_api_server().transport)
        self.client.base_url = "http://in-process.invalid./"
        self._last_runner_comms = 0.0
    def send_msg(self, resp, request_id, error, **dump_opts):
        self.reply = (type(resp).__name__, resp.model_dump(mode="json", **dump_opts))

def request(kind, arg):
    return {"conn": lambda: GetConnection(conn_id=arg), "var": lambda: GetVariable(key=arg),
            "keys": lambda: GetVariableKeys(prefix=arg)}[kind]()

answers = []
for kind, arg in json.loads(sys.argv[1]):
    supervisor = Supervisor()
    TriggerRunnerSupervisor._handle_request(supervisor, request(kind, arg),
                                            structlog.get_logger(), 1)
    answers.append(supervisor.reply)
with open(sys.argv[2], "w") as out:
    json.dump(answers, out)
"""

# The same conn_id of three scopes, a connection and a variable only BETA has, values of no
# team, the namespace of BETA's variables spelled as an id, and the variable keys.
REQUESTS = [("conn", SHARED), ("conn", BETA_CONN), ("conn", GLOBAL_DB_CONN),
            ("conn", f"_{BETA.upper()}___{SHARED}"), ("var", BETA_VAR), ("var", GLOBAL_VAR),
            ("keys", "tf_")]


@pytest.fixture
async def team_runtime(airflow_db: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """Teams ALPHA and BETA, their secrets, multi_team on, and the runtime ``consume
    --airflow`` starts (its child inherits this environment)."""
    from triggerflow.airflow import runtime

    dsn = af.dsn_of(airflow_db)
    await af.prepare(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        await conn.executemany("INSERT INTO team (name) VALUES ($1)", [(ALPHA,), (BETA,)])
    finally:
        await conn.close()
    env = {**os.environ, **af.airflow_env(airflow_db), **ENVIRONMENT}
    subprocess.run([sys.executable, "-c", SEED], env=env, check=True, timeout=120,
                   capture_output=True)
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", af.sqlalchemy_url(airflow_db))
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    async with runtime.serving() as process:
        yield process, env


def airflows_answers(env: dict[str, str], out: Path) -> list[Any]:
    done = subprocess.run([sys.executable, "-c", AIRFLOW_ANSWERS, json.dumps(REQUESTS), str(out)],
                          env=env, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return [tuple(a) for a in json.loads(out.read_text())]


async def triggerflows_answers(process: Any) -> list[Any]:
    """Each request through the consumer's comms to its runtime child, as trigger code's
    requests go; an error answer is raised by Airflow's decoder and taken back out here."""
    from airflow.sdk.exceptions import AirflowRuntimeError
    from airflow.sdk.execution_time.comms import GetConnection, GetVariable, GetVariableKeys

    build: dict[str, Callable[[str], Any]] = {
        "conn": lambda a: GetConnection(conn_id=a), "var": lambda a: GetVariable(key=a),
        "keys": lambda a: GetVariableKeys(prefix=a)}
    answers = []
    for kind, arg in REQUESTS:
        try:
            resp = await process.comms.asend(build[kind](arg))
        except AirflowRuntimeError as exc:
            resp = exc.error
        # dumped as the child sent it (handle_get_connection's options for a connection)
        options = {"exclude_unset": True, "by_alias": True} if kind == "conn" else \
            {"exclude_unset": True} if kind == "var" else {}
        answers.append((type(resp).__name__, resp.model_dump(mode="json", **options)))
    return answers


async def test_the_runtime_answers_what_airflows_triggerer_answers_under_multi_team(
        team_runtime: Any, tmp_path: Path) -> None:
    process, env = team_runtime
    ours = await triggerflows_answers(process)
    airflows = airflows_answers(env, tmp_path / "airflow.json")

    assert ours == airflows
    by_request = dict(zip(REQUESTS, ours, strict=True))
    # no team resolved: the value of no team, never a team's
    assert by_request[("conn", SHARED)][1]["login"] == "global"
    assert by_request[("conn", GLOBAL_DB_CONN)][1]["login"] == "global-db"
    assert by_request[("var", GLOBAL_VAR)][1]["value"] == "everyone's"
    for secret in [("conn", BETA_CONN), ("conn", f"_{BETA.upper()}___{SHARED}"),
                   ("var", BETA_VAR)]:
        assert by_request[secret][0] == "ErrorResponse", by_request[secret]
    # Airflow lists every key, a team's too (the route filters by team only when it resolves
    # one); the values stay out of reach
    assert by_request[("keys", "tf_")][1]["keys"] == [BETA_VAR, GLOBAL_VAR]


async def test_a_teams_trigger_never_reads_another_teams_secret(team_runtime: Any) -> None:
    """The whole path of trigger code in a consumer of ALPHA: the trigger side's secrets chain
    (environment variables first, as in Airflow's trigger runner), then the runtime child."""
    from tests.airflow_triggers import RuntimeReadingTrigger

    kind, body = await fire(RuntimeReadingTrigger(SHARED, GLOBAL_VAR), timeout=60)
    assert kind is EventKind.RESUME, body
    from tests.test_airflow_runtime import payload_of

    read = payload_of(body)
    assert (read["login"], read["host"], read["variable"]) == (
        "global", "global.example", "everyone's")
    for conn_id, variable in [(BETA_CONN, GLOBAL_VAR), (SHARED, BETA_VAR),
                              (f"_{BETA.upper()}___{SHARED}", GLOBAL_VAR)]:
        kind, body = await fire(RuntimeReadingTrigger(conn_id, variable), timeout=60)
        assert kind is EventKind.FAIL, (conn_id, variable, body)
        assert not [s for s in BETAS_SECRETS if s in json.dumps(body)], body
