"""``triggerflow bench chaos --mode airflow``: the chaos run of ``chaos.py`` against a real
Airflow 3.3.2 metadata database served by ``consume --airflow`` and ``writer --airflow``.

Services of its own, as native mode: a PostgreSQL cluster started for the run (the nemesis
restarts it) holding a metadata database made by ``airflow db migrate`` (``AirflowStack``;
no Airflow process runs: no scheduler, no API server, no triggerer) and a namespace of its
own on the broker. The chaos DAG (``chaos_airflow_worker.CHAOS_DAG``: one mapped
``DateTimeSensorAsync`` per team queue) is stored by ``airflow dags reserialize`` and its
run, with a task instance for every task of the schedule, made by Airflow's
``create_dagrun``. The workload is the same schedule (``chaos_plan``), written by Airflow's
code in a child process (``chaos_airflow_worker``): deferrals to Airflow's ``DateTimeTrigger``
or to an Airflow coroutine trigger (``chaos_airflow_trigger.ChaosWait``, a resume or a
task-end ``success``), re-deferrals as the task's next try (cleared by Airflow, a new
``try_number`` and trigger row), cancels as the task marked ``failed``. The nemesis is native
mode's (``chaos_faults``) with the fault kinds that apply to Airflow mode (``KINDS``); the
history is mapped to native mode's format (``chaos_airflow_audit``) and checked by
``chaos_check`` unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.chaos_airflow_audit import AUDIT, FINAL_DEFERRED, FINAL_TRIGGERS, native_audit
from bench.chaos_check import BOUND
from bench.chaos_plan import TEAMS, Op, Plan
from bench.chaos_run import (
    dead_letters,
    json_or_none,
    messages,
    nemesis,
    private_cluster,
    retry,
)
from bench.harness import Bench

if TYPE_CHECKING:
    from rich.console import Console

    from testbed.services import PostgresCluster
    from triggerflow.settings import Settings

# The nemesis's fault kinds that apply to Airflow mode: processes, PostgreSQL, replays.
KINDS = ("consumer_kill", "consumer_term", "consumer_stop", "writer_kill", "writer_term",
         "writer_stop", "pg_restart", "pg_terminate", "replay")
DRAIN = 90.0  # seconds past the last due moment the drain may take at most
TIMEOUT = 30.0  # a request the worker has not answered by then is recorded as failed
GRANTS = ("GRANT USAGE ON SCHEMA public, triggerflow TO {u}; "
          "GRANT ALL ON ALL TABLES IN SCHEMA public, triggerflow TO {u}; "
          "GRANT ALL ON ALL SEQUENCES IN SCHEMA public, triggerflow TO {u}")


@dataclass
class AirflowBench(Bench):
    """``Bench`` on an Airflow metadata database: Airflow mode's processes (with the stack's
    ``AIRFLOW__*`` environment: its Fernet key decrypts the trigger kwargs), each of the
    ``tfbench_*`` roles the nemesis terminates connections of."""

    airflow_env: dict[str, str] = field(default_factory=dict)

    def env(self, role: str, **overrides: Any) -> dict[str, str]:
        return {**super().env(role, **overrides), **self.airflow_env}

    async def setup(self) -> None:
        import asyncpg

        from bench.common import ROLES, _with_user
        from triggerflow.transport.rabbitmq import RabbitTransport, Topology

        self.mon = await asyncpg.create_pool(self.admin_dsn, min_size=1, max_size=3)
        for role in ROLES:
            user = f"tfbench_{role}"
            await self.mon.execute(f"CREATE ROLE {user} LOGIN")
            await self.mon.execute(GRANTS.format(u=user))
            self.role_dsn[role] = _with_user(self.admin_dsn, user)
        self.broker = RabbitTransport(self.settings.amqp_dsn(), Topology(self.namespace),
                                      name="bench")
        await self.broker.connect()
        await self.broker.declare([self.queue, self.idle_queue])


async def airflow_history(settings: Settings, plan: Plan, console: Console,
                          out: Path) -> dict[str, Any]:
    """The run's history, in native mode's format (``chaos_check.check`` reads it)."""
    from pydantic import SecretStr

    from bench.chaos_airflow_worker import chaos_dag
    from bench.common import FULL
    from testbed.airflow_stack import AirflowStack
    from triggerflow.airflow.setup import setup as airflow_setup

    ns = f"{settings.namespace}-chaosaf{uuid.uuid4().hex[:4]}"
    queues = {team: f"{ns}.team-{team}" for team in TEAMS}
    tasks = _tasks(plan.ops)
    counts = [(t, queues[t], max(1, sum(1 for team, _ in tasks.values() if team == t)))
              for t in TEAMS]
    async with private_cluster("chaosaf") as (root, cluster):
        (root / "dags").mkdir()
        (root / "airflow").mkdir()
        (root / "dags" / "tf_chaos.py").write_text(chaos_dag(counts))
        stack = AirflowStack(cluster.url, root / "dags", home=root / "airflow")
        migrate_s = await asyncio.to_thread(stack.migrate)
        await asyncio.to_thread(stack.run_cli, "dags", "reserialize", timeout=300)
        release = await airflow_setup(stack.database_url)
        console.log(f"Airflow {release} metadata database {stack.database} migrated in "
                    f"{migrate_s:.0f}s; the chaos DAG stored")
        own = settings.model_copy(update={
            "database_url": SecretStr(stack.database_url), "namespace": ns, "queues": [],
            "airflow": True, "airflow_resume_delay": timedelta(0),  # no scheduler to wait for
            "allowed_modules": ["airflow.providers.standard.triggers", "bench"]})
        b = AirflowBench(own, FULL, console, out, admin_dsn=stack.database_url, namespace=ns,
                         queue=queues[TEAMS[0]], idle_queue=queues[TEAMS[1]],
                         airflow_env={k: v for k, v in stack.env.items()
                                      if k.startswith("AIRFLOW")})
        try:
            await b.setup()
            await b.db().execute(AUDIT)
            return await _scenario(b, cluster, plan, stack.env, tasks, queues)
        finally:
            await b.teardown()


def _tasks(ops: tuple[Op, ...]) -> dict[str, tuple[str, int]]:
    """Each task of the schedule -> its team and map index (in order of first deferral)."""
    tasks: dict[str, tuple[str, int]] = {}
    per_team = dict.fromkeys(TEAMS, 0)
    for op in ops:
        if op.op == "defer" and op.task not in tasks:
            tasks[op.task] = (op.team, per_team[op.team])
            per_team[op.team] += 1
    return tasks


async def _scenario(b: AirflowBench, cluster: PostgresCluster, plan: Plan,
                    airflow_env: dict[str, str], tasks: dict[str, tuple[str, int]],
                    queues: dict[str, str]) -> dict[str, Any]:
    from bench.chaos_faults import EventTap, Fleet, slot_pids

    assert b.broker is not None
    run_id = f"chaos_s{plan.seed}"
    work = AirflowWorkload(b, queues, tasks, run_id)
    await work.start(airflow_env)
    fleet = Fleet(b, {team: queues[team] for team in TEAMS})
    await fleet.start_all(within=300)  # each imports Airflow and warms its runtime up
    tap = EventTap(b.settings.amqp_dsn(), b.broker.topology.events)
    await tap.start()
    faults = tuple(f for f in plan.faults if f.kind in KINDS)
    b.log(f"2 consumers --airflow on each of {', '.join(queues.values())}, 2 writers "
          f"--airflow; {len(work.tasks)} task instances; chaos for {plan.seconds:.0f}s "
          f"({len(plan.faults) - len(faults)} faults of kinds native mode only skipped)")
    watcher = asyncio.get_running_loop().create_task(fleet.watch())
    t0 = time.time()
    try:
        await asyncio.gather(work.run(plan.ops, t0),
                             nemesis(dataclasses.replace(plan, faults=faults), fleet, tap,
                                      cluster, t0, work.faults))
        b.log(f"chaos over: {len(work.deferrals)} deferrals, {len(work.cancels)} cancels, "
              f"{sum(f['happened'] for f in work.faults)} faults, {len(fleet.exits)} "
              "processes exited by themselves (restarted); draining")
        await fleet.thaw_all()
        drained = await _drain(b, queues, work)
    finally:
        watcher.cancel()
        await tap.close()
        await work.close()
    rows = await retry(b, lambda db: db.fetch("SELECT * FROM chaos_audit ORDER BY seq"))
    return {
        "mode": "airflow", "seed": plan.seed, "seconds": plan.seconds,
        "schedule": plan.digest(), "started": t0, "deferrals": list(work.deferrals.values()),
        "cancels": work.cancels, "faults": work.faults, "exits": fleet.exits,
        "pids": slot_pids(fleet), "bounds": BOUND, "drained": drained,
        "served_again": work.served_again,
        "audit": native_audit([{**r, "event": json_or_none(r["event"]), "xvalue": json_or_none(r["xvalue"])}
                               for r in rows]),
        "final": {
            "triggers": [dict(r) for r in await retry(b, lambda db: db.fetch(FINAL_TRIGGERS))],
            "deferred": [dict(r) for r in await retry(b, lambda db: db.fetch(FINAL_DEFERRED))],
            "messages": await messages(b, queues), "dead_letters": await dead_letters(b)},
    }


class AirflowWorkload:
    """The plan's operations at their moments, each sent to the Airflow worker as it comes
    (a request slowed by a fault delays no other), recorded with their outcome as native
    mode's ``Workload`` records them."""

    def __init__(self, b: AirflowBench, queues: dict[str, str],
                 tasks: dict[str, tuple[str, int]], run_id: str) -> None:
        self.b = b
        self.queues = queues
        self.tasks = tasks
        self.run_id = run_id
        self.deferrals: dict[str, dict[str, Any]] = {}
        self.cancels: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.attempts: dict[str, int] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.sent = 0
        self.served_again: float | None = None  # every team queue had its consumers again

    async def start(self, env: dict[str, str], within: float = 120.0) -> None:
        from bench.common import with_checkout

        log = (self.b.out / "airflow-worker.log").open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.chaos_airflow_worker", self.run_id,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log,
            env={**with_checkout(env), "PYTHONUNBUFFERED": "1"})
        log.close()
        ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[-1] = ready
        self.reader = asyncio.get_running_loop().create_task(self._read())
        self.b.log(f"Airflow worker: {await asyncio.wait_for(ready, within)}")

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for line in self.proc.stdout:
            text = line.decode(errors="replace")
            if not text.startswith("CHAOS "):
                continue  # Airflow's own output
            answer = json.loads(text[6:])
            future = self.waiting.pop(-1 if answer.get("ready") else answer["id"], None)
            if future is not None and not future.done():
                future.set_result(answer)

    async def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.sent += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[self.sent] = future
        self.proc.stdin.write((json.dumps({**request, "id": self.sent}) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            return await asyncio.wait_for(future, TIMEOUT)
        except TimeoutError:
            return {"ok": False, "error": f"no answer from the Airflow worker in {TIMEOUT:g}s"}

    async def run(self, ops: tuple[Op, ...], t0: float) -> None:
        calls = []
        for op in ops:
            await asyncio.sleep(max(0.0, t0 + op.at - time.time()))
            calls.append(asyncio.ensure_future(
                self.defer(op) if op.op == "defer" else self.cancel(op)))
        await asyncio.gather(*calls)

    async def defer(self, op: Op) -> None:
        at = time.time()
        attempt = self.attempts[op.task] = self.attempts.get(op.task, 0) + 1
        team, index = self.tasks[op.task]
        rec: dict[str, Any] = {"d": op.d, "task": op.task, "queue": self.queues[op.team],
                               "kind": op.kind, "due": at + op.lead, "at": at,
                               "again": op.again, "attempt": attempt, "ok": False,
                               "trigger_id": None, "error": None}
        self.deferrals[op.d] = rec
        answer = await self.ask({"op": "defer", "task_id": f"wait_{team}", "map_index": index,
                                 "kind": op.kind, "due": rec["due"], "d": op.d})
        if answer["ok"]:
            rec.update(ok=True, trigger_id=answer["trigger_id"], cleared=answer["cleared"])
        else:
            rec["error"] = answer["error"]
        rec["done"] = time.time()

    async def cancel(self, op: Op) -> None:
        target = self.deferrals.get(op.d)
        rec: dict[str, Any] = {"d": op.d, "at": time.time(), "ok": False, "moved": None,
                               "error": None}
        self.cancels.append(rec)
        if target is None or target["trigger_id"] is None:
            rec["error"] = "skipped: its deferral did not return a trigger id"
            return
        team, index = self.tasks[target["task"]]
        answer = await self.ask({"op": "cancel", "task_id": f"wait_{team}", "map_index": index,
                                 "trigger_id": target["trigger_id"]})
        if answer["ok"]:
            rec.update(ok=True, moved=answer["moved"])
        else:
            rec["error"] = answer["error"]

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self.reader is not None:
            self.reader.cancel()


async def _drain(b: Bench, queues: dict[str, str], work: AirflowWorkload,
                 ready_within: float = 300.0) -> bool:
    """Until no task is deferred, no trigger row is left and the queues are empty; at most
    ``DRAIN`` s past the last due moment or the moment every team queue had its two
    consumers again, whichever is later (a consumer that imports Airflow and warms its
    runtime up takes tens of seconds on a loaded machine before it subscribes)."""
    last_due = max((d["due"] for d in work.deferrals.values()), default=time.time())
    ready_by = time.time() + ready_within
    while time.time() < ready_by:
        if all([await b.broker_consumers(q) >= 2 for q in queues.values()]):
            break
        await asyncio.sleep(1.0)
    work.served_again = time.time()
    deadline = max(time.time(), last_due) + DRAIN
    while time.time() < deadline:
        busy = await retry(b, lambda db: db.fetchval(
            "SELECT (SELECT count(*) FROM task_instance WHERE state = 'deferred') "
            "+ (SELECT count(*) FROM trigger)"))
        if busy == 0 and sum((await messages(b, queues)).values()) == 0:
            return True
        await asyncio.sleep(1.0)
    return False
