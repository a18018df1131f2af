"""A real Airflow 3 stack on this machine, for the e2e tests and ``triggerflow bench airflow``.

``AirflowStack`` owns an ``AIRFLOW_HOME`` in a temporary directory and a fresh PostgreSQL
database for Airflow's metadata (on the server the caller names, e.g. the tests' ``pg_server``). It
runs ``airflow db migrate``, then starts Airflow's scheduler, API server and dag-processor
with the LocalExecutor and ``[triggerer] queues_enabled = True`` (so a trigger row carries
the deferring task's queue). It never starts ``airflow triggerer`` unless asked
(``start_triggerer``): in Airflow mode triggerflow's processes take its place.

Every process is bounded: starts wait for the API server's health endpoint with a deadline,
``stop()`` ends each process group (SIGTERM, then SIGKILL) and drops the database. Each
process writes ``<home>/<name>.log``; ``tail_logs()`` returns their ends for failure
messages.

Airflow is imported only by the child processes (``airflow`` next to this interpreter), so
importing this module costs nothing. Needs the ``triggerflow[airflow]`` extra.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testbed.services import free_port

SERVICES = ("scheduler", "api-server", "dag-processor")
STOP_GRACE = 15.0  # seconds a process gets after SIGTERM before SIGKILL
# A migrated database to copy instead of migrating (``AirflowStack.migrate``).
TEMPLATE_VARIABLE = "TESTBED_AIRFLOW_TEMPLATE"


class AirflowStackError(RuntimeError):
    """A command failed or a wait ran out; the message carries the processes' log tails."""


def airflow_bin() -> Path:
    """The ``airflow`` script installed beside this interpreter (the project's venv)."""
    return Path(sys.executable).with_name("airflow")


def _admin(server_url: str, statement: str) -> None:
    """Run one statement on the server's maintenance database (CREATE / DROP DATABASE)."""
    import psycopg2  # type: ignore[import-untyped]  # installed by the airflow extra

    conn = psycopg2.connect(f"{server_url}/postgres")
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(statement)
    finally:
        conn.close()


@dataclass
class AirflowProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class AirflowStack:
    """One Airflow deployment: home directory, metadata database, its processes.

    ``server_url`` is a PostgreSQL server URL without a database (``postgresql://user@host:port``);
    ``dags_folder`` holds the DAG files; ``extra_env`` is added to every process's environment
    (e.g. ``PYTHONPATH`` for trigger modules, ``AIRFLOW_CONN_*``).
    """

    server_url: str
    dags_folder: Path
    extra_env: Mapping[str, str] = field(default_factory=dict)
    home: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="airflow-home-")))
    database: str = field(default_factory=lambda: f"af_{uuid.uuid4().hex[:12]}")
    port: int = field(default_factory=free_port)
    processes: dict[str, AirflowProcess] = field(default_factory=dict)
    _created_db: bool = False
    _token: str | None = None
    _groups: set[int] = field(default_factory=set)

    # ------------------------------------------------------------------ configuration

    @property
    def database_url(self) -> str:
        """The metadata database as a plain PostgreSQL URL (what triggerflow is given)."""
        return f"{self.server_url}/{self.database}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """The environment every Airflow process of this stack runs with."""
        key = self.home / ".keys.json"
        if not key.exists():  # one set of secrets per stack, shared by all its processes
            key.write_text(json.dumps({
                "fernet": base64.urlsafe_b64encode(os.urandom(32)).decode(),
                "jwt": secrets.token_urlsafe(32), "api": secrets.token_urlsafe(32)}))
        keys = json.loads(key.read_text())
        sqlalchemy_url = self.database_url.replace("postgresql://", "postgresql+psycopg2://", 1)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__FERNET_KEY": keys["fernet"],
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__CORE__PARALLELISM": "16",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": keys["api"],
            "AIRFLOW__API_AUTH__JWT_SECRET": keys["jwt"],
            # A trigger row carries the queue of the task that deferred (3.2+): the team queue.
            "AIRFLOW__TRIGGERER__QUEUES_ENABLED": "True",
            # Deferral timeouts are the scheduler's job; check often so tests stay short.
            "AIRFLOW__SCHEDULER__TRIGGER_TIMEOUT_CHECK_INTERVAL": "1",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.home / "logs"),
        })
        env.update(self.extra_env)
        return env

    # ------------------------------------------------------------------ lifecycle

    def migrate(self, timeout: float = 240.0) -> float:
        """Create the metadata database and run ``airflow db migrate``; returns seconds taken.

        With ``TESTBED_AIRFLOW_TEMPLATE`` naming a database on the same server that this
        Airflow's ``airflow db migrate`` already made (the suite's session template), the
        database is a copy of it instead: the same schema in a second rather than a minute."""
        t0 = time.monotonic()
        template = os.environ.get(TEMPLATE_VARIABLE)
        if template:
            _admin(self.server_url, f'CREATE DATABASE "{self.database}" TEMPLATE "{template}"')
            self._created_db = True
            return time.monotonic() - t0
        _admin(self.server_url, f'CREATE DATABASE "{self.database}"')
        self._created_db = True
        self.run_cli("db", "migrate", timeout=timeout)
        return time.monotonic() - t0

    def run_cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run one ``airflow`` CLI command in this stack's environment; raise on failure."""
        try:
            done = subprocess.run([str(airflow_bin()), *args], env=self.env, cwd=self.home,
                                  capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise AirflowStackError(f"airflow {' '.join(args)}: no answer in {timeout:.0f}s") from exc
        if done.returncode != 0:
            raise AirflowStackError(f"airflow {' '.join(args)} exited {done.returncode}:\n"
                                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> AirflowProcess:
        """Start a long-running process (its own process group) logging to ``<home>/<name>.log``."""
        log = self.home / f"{name}.log"
        with log.open("ab") as out:
            # Unbuffered: a failing test's tail shows what the process did up to then.
            popen = subprocess.Popen(argv, env={**self.env, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     cwd=self.home,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = AirflowProcess(name, popen, log)
        self.processes[name] = proc
        self._groups.add(popen.pid)
        return proc

    def start(self, services: Iterable[str] = SERVICES, timeout: float = 120.0) -> float:
        """Start Airflow's own services and wait until the API server reports them healthy."""
        t0 = time.monotonic()
        for service in services:
            self.spawn(service, [str(airflow_bin()), service])
        self.wait_healthy(["metadatabase", *(s.replace("-", "_") for s in services
                                             if s != "api-server")], timeout)
        return time.monotonic() - t0

    def start_triggerer(self, queues: Iterable[str], timeout: float = 120.0) -> AirflowProcess:
        """Airflow's own ``airflow triggerer`` on the given queues (the baseline)."""
        proc = self.spawn("triggerer", [str(airflow_bin()), "triggerer", "--queues", ",".join(queues)])
        self.wait_healthy(["triggerer"], timeout)
        return proc

    def health(self) -> dict[str, Any]:
        response = httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=5.0)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def wait_healthy(self, components: Iterable[str], timeout: float) -> None:
        """Wait until each named component of the health endpoint says ``healthy``."""
        wanted = list(components)
        deadline = time.monotonic() + timeout
        last: object = "no answer"
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                report = self.health()
            except (httpx.HTTPError, ValueError) as exc:
                last = exc
            else:
                last = report
                if all((report.get(c) or {}).get("status") == "healthy" for c in wanted):
                    return
            time.sleep(0.5)
        raise AirflowStackError(f"{wanted} not healthy within {timeout:.0f}s (last: {last})\n"
                                + self.tail_logs())

    def check_alive(self) -> None:
        dead = [p for p in self.processes.values() if not p.alive()]
        if dead:
            raise AirflowStackError(
                ", ".join(f"{p.name} exited {p.popen.returncode}" for p in dead) + "\n"
                + self.tail_logs())

    def stop_process(self, name: str) -> None:
        proc = self.processes.pop(name, None)
        if proc is None or not proc.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(10)

    def stop(self, keep_home: bool = False) -> None:
        """End every process of the stack (children included), drop its database."""
        self._groups.update(p.popen.pid for p in self.processes.values())
        for name in list(self.processes):
            self.stop_process(name)
        if self._created_db:
            _admin(self.server_url, f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            self._created_db = False
        if not keep_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Pids still alive in any process group this stack started (should be none)."""
        groups = self._groups | {p.popen.pid for p in self.processes.values()}
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) in groups and fields[0] != "Z":  # field 5: process group
                found.append(int(stat.parent.name))
        return found

    def tail_logs(self, lines: int = 40) -> str:
        parts = []
        # triggerflow's processes (``tf-*``) last: a report that shortens the middle of a
        # failure's output keeps its end.
        for log in sorted(self.home.glob("*.log"), key=lambda p: (p.name.startswith("tf-"), p.name)):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"----- {log.name} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(parts)

    # ------------------------------------------------------------------ REST API

    def _headers(self) -> dict[str, str]:
        if self._token is None:  # simple auth manager, all admins: a token without credentials
            response = httpx.get(f"{self.base_url}/auth/token", timeout=10.0)
            response.raise_for_status()
            self._token = str(response.json()["access_token"])
        return {"Authorization": f"Bearer {self._token}"}

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        response = httpx.request(method, f"{self.base_url}/api/v2/{path.lstrip('/')}",
                                 headers=self._headers(), timeout=30.0, **kwargs)
        if response.status_code >= 400:
            raise AirflowStackError(f"{method} {path}: {response.status_code} {response.text}")
        return response.json()

    def wait_for_dags(self, dag_ids: Iterable[str], timeout: float = 120.0) -> None:
        """Wait until the dag-processor has parsed and stored every named DAG."""
        wanted = set(dag_ids)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            found = {d["dag_id"] for d in self.api("GET", "dags", params={"limit": 100})["dags"]}
            if wanted <= found:
                return
            time.sleep(1.0)
        raise AirflowStackError(f"DAGs {sorted(wanted)} not parsed within {timeout:.0f}s\n"
                                + self.tail_logs())

    def trigger_dag(self, dag_id: str, conf: Mapping[str, Any] | None = None) -> str:
        """Start a DAG run now through the REST API; returns its run id."""
        body = {"logical_date": None, "conf": dict(conf or {})}
        return str(self.api("POST", f"dags/{dag_id}/dagRuns", json=body)["dag_run_id"])
