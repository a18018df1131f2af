"""``triggerflow bench chaos --seed S --minutes M``: a randomized fault schedule over a
randomized workload, then a checker of the whole history (``chaos_check.py``).

Services of its own: a PostgreSQL cluster started for the run (``testbed/services.py``; the
nemesis restarts it) and a namespace of its own on the given broker. Two team queues with
two ``consume`` each and two ``writer``s, with shipped defaults. For ``M`` minutes the
workload (``chaos_plan.py``, from the seed) defers timers, coroutine triggers and task-end
triggers at random instants, cancels some and defers some tasks again, while the nemesis
(``chaos_faults.py``) kills, stops and terminates processes, restarts PostgreSQL, closes
connections from the server, delivers events again, skews a consumer's clock and sends bad
input (``chaos_bad.py``: recorded apart, judged as docs/security.md says). Every operation
and fault is recorded; every change of a task row is recorded by a row trigger of the run's own
(``chaos_audit``). Then the faults stop, every process runs again, and the run drains: until
no task is deferred, no trigger row is left and the queues are empty (or the drain times out).
With ``--topology cluster`` the servers are a PostgreSQL primary with a synchronous standby
and a 3-node RabbitMQ cluster, reached through both servers' URL and a forwarder
(``chaos_cluster.py``), and the nemesis also promotes the standby and stops broker nodes.
The history is written to ``bench-results/chaos-<seed>-<time>.json`` and checked; the last
line printed is the checker's summary, and the exit status is 1 when it found a task lost,
ended twice or resumed by a stale event, or something left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.chaos_check import BOUND, Report, check
from bench.chaos_plan import TEAMS, Op, Plan, make_plan
from bench.chaos_run import (
    dead_letters,
    json_or_none,
    messages,
    nemesis,
    private_cluster,
    retry,
)

if TYPE_CHECKING:
    from rich.console import Console

    from bench.chaos_cluster import Cluster
    from bench.harness import Bench
    from testbed.services import PostgresCluster
    from triggerflow.settings import Settings

DRAIN = 90.0  # seconds past the last due moment the drain may take at most
TIMEOUT = 30.0  # an SDK call that takes longer is recorded as failed

AUDIT = """
CREATE TABLE chaos_audit (
    seq bigserial PRIMARY KEY, at float8 NOT NULL, op text NOT NULL, task text, queue text,
    old_state text, new_state text, old_d text, new_d text, old_trigger bigint,
    new_trigger bigint, next_method text, event jsonb, result jsonb, error text,
    applied float8, old_applied float8);
CREATE FUNCTION chaos_audit_row() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = public AS $$
BEGIN
    INSERT INTO chaos_audit (at, op, task, queue, old_state, new_state, old_d, new_d,
                             old_trigger, new_trigger, next_method, event, result, error,
                             applied, old_applied)
    VALUES (extract(epoch FROM clock_timestamp()), left(TG_OP, 1), NEW.task_id, NEW.queue,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.state END, NEW.state,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.next_kwargs->>'d' END, NEW.next_kwargs->>'d',
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.trigger_id END, NEW.trigger_id,
            NEW.next_method, NEW.next_kwargs->'event', NEW.result, NEW.next_kwargs->>'error',
            extract(epoch FROM NEW.event_applied_at),
            CASE WHEN TG_OP = 'UPDATE' THEN extract(epoch FROM OLD.event_applied_at) END);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON task_instance
    FOR EACH ROW EXECUTE FUNCTION chaos_audit_row();
"""


def run_chaos(settings: Settings, *, seed: int | None, minutes: float, mode: str,
              topology: str = "single") -> int:
    from rich.console import Console

    seed = random.randrange(1, 10**6) if seed is None else seed
    console = Console(log_path=False, width=None if sys.stdout.isatty() else 150)
    plan = make_plan(seed, minutes * 60, topology)
    console.log(f"chaos seed={seed} minutes={minutes:g} topology={topology}: {len(plan.ops)} "
                f"operations, {len(plan.faults)} faults planned (schedule {plan.digest()})")
    report = asyncio.run(_run(settings, plan, console, mode, topology))
    print("\n".join(report.lines()), flush=True)
    return 0 if report.ok else 1


async def _with_cluster(settings: Settings, plan: Plan, console: Console, out: Path,
                        topology: str) -> dict[str, Any]:
    from pydantic import SecretStr

    from bench.common import FULL
    from bench.harness import Bench
    async with contextlib.AsyncExitStack() as stack:
        update: dict[str, Any] = {"namespace": f"{settings.namespace}-chaos{uuid.uuid4().hex[:4]}"}
        servers: Cluster | None = None
        if topology == "cluster":  # both servers' URL and the forwarder, as behind a failover
            from bench.chaos_cluster import private_topology

            servers = await stack.enter_async_context(private_topology())
            cluster = servers.pg.primary
            update.update(database_url=SecretStr(servers.pg.dsn("chaos")),
                          amqp_url=SecretStr(servers.amqp_url), management_url=None)
        else:
            _, cluster = await stack.enter_async_context(private_cluster("chaos"))
            update["database_url"] = SecretStr(f"{cluster.url}/chaos")
        b = Bench.create(settings.model_copy(update=update), FULL, console, out)
        # Bench's two queues are the two teams' (both deleted at the end)
        b.queue, b.idle_queue = f"{b.namespace}.team-a", f"{b.namespace}.team-b"
        try:
            await b.setup()
            return await _scenario(b, cluster, plan, servers)
        finally:
            await b.teardown()


async def _run(settings: Settings, plan: Plan, console: Console, mode: str,
               topology: str) -> Report:
    import logging

    for noisy in ("aiormq", "aio_pika", "asyncpg", "triggerflow"):  # restarts are the point
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path("bench-results") / f"logs-chaos-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    if mode == "airflow":  # the same schedule against an Airflow metadata database
        from bench.chaos_airflow import airflow_history

        history = await airflow_history(settings, plan, console, out)
    else:
        history = await _with_cluster(settings, plan, console, out, topology)
        history["topology"] = topology
    path = Path("bench-results") / f"chaos-{plan.seed}-{stamp}.json"
    path.write_text(json.dumps(history, indent=None, default=str))
    report = check(history)
    console.log(f"history: {path} (check it again: python -m bench.chaos_check {path}); "
                f"process logs in {out}")
    if plan.seconds >= 600:  # a long run is a result; a short one judges nothing
        _record(plan, report, mode, topology)
    return report


async def _scenario(b: Bench, cluster: PostgresCluster, plan: Plan,
                    servers: Cluster | None) -> dict[str, Any]:
    from bench.chaos_faults import EventTap, Fleet, slot_pids

    await b.db().execute(AUDIT)
    assert b.broker is not None
    queues = {TEAMS[0]: b.queue, TEAMS[1]: b.idle_queue}
    fleet = Fleet(b, queues)
    await fleet.start_all()
    tap = EventTap(b.settings.amqp_dsn(), b.broker.topology.events)
    await tap.start()
    b.log(f"2 consumers on each of {', '.join(queues.values())}, 2 writers; chaos for "
          f"{plan.seconds:.0f}s")
    watcher = asyncio.get_running_loop().create_task(fleet.watch())
    work = Workload(b, queues, plan.seed)
    t0 = time.time()
    try:
        await asyncio.gather(work.run(plan.ops, t0),
                             nemesis(plan, fleet, tap, cluster, t0, work.faults, servers))
        b.log(f"chaos over: {len(work.deferrals)} deferrals, {len(work.cancels)} cancels, "
              f"{sum(f['happened'] for f in work.faults)} faults, {len(fleet.exits)} "
              "processes exited by themselves (restarted); draining")
        await fleet.thaw_all()
        drained = await _drain(b, queues, work)
    finally:
        watcher.cancel()
        await tap.close()
    history = {
        "seed": plan.seed, "seconds": plan.seconds, "schedule": plan.digest(), "started": t0,
        "deferrals": list(work.deferrals.values()), "cancels": work.cancels,
        "faults": work.faults, "exits": fleet.exits, "pids": slot_pids(fleet),
        "bounds": BOUND, "drained": drained,
    }
    rows = await retry(b, lambda db: db.fetch("SELECT * FROM chaos_audit ORDER BY seq"))
    history["audit"] = [{**r, "event": json_or_none(r["event"]), "result": json_or_none(r["result"])}
                        for r in rows]
    history["final"] = await _final(b, queues)
    return history


class Workload:
    """Runs the plan's operations through the SDK at their moments, each as its own task
    (a call slowed by a fault delays no other), and records each with its outcome."""

    def __init__(self, b: Bench, queues: dict[str, str], seed: int) -> None:
        self.b = b
        self.queues = queues
        self.run_id = f"s{seed}"
        self.deferrals: dict[str, dict[str, Any]] = {}
        self.cancels: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.attempts: dict[str, int] = {}  # deferrals of each task so far

    async def run(self, ops: tuple[Op, ...], t0: float) -> None:
        calls = []
        for op in ops:
            await asyncio.sleep(max(0.0, t0 + op.at - time.time()))
            calls.append(asyncio.ensure_future(
                self.defer(op) if op.op == "defer" else self.cancel(op)))
        await asyncio.gather(*calls)

    async def defer(self, op: Op) -> None:
        from bench.chaos_trigger import ChaosWait
        from triggerflow.model import TaskKey
        from triggerflow.sdk import Deferral
        from triggerflow.triggers import DateTimeTrigger

        assert self.b.client is not None
        at = time.time()
        due = at + op.lead
        trigger = (DateTimeTrigger(datetime.fromtimestamp(due, UTC)) if op.kind == "timer"
                   else ChaosWait(due, op.d, end=op.kind == "end"))
        attempt = self.attempts[op.task] = self.attempts.get(op.task, 0) + 1
        rec: dict[str, Any] = {"d": op.d, "task": op.task, "queue": self.queues[op.team],
                               "kind": op.kind, "due": due, "at": at, "again": op.again,
                               "attempt": attempt, "ok": False, "trigger_id": None,
                               "error": None}
        self.deferrals[op.d] = rec
        try:
            ids = await asyncio.wait_for(self.b.client.defer_many([Deferral(
                TaskKey("chaos", op.task, self.run_id), trigger, rec["queue"],
                kwargs={"d": op.d})]), TIMEOUT)
            rec.update(ok=True, trigger_id=ids[0])
        except Exception as exc:  # a store restart outlasting the SDK's retries
            rec["error"] = repr(exc)[:300]
        rec["done"] = time.time()

    async def cancel(self, op: Op) -> None:
        target = self.deferrals.get(op.d)
        rec: dict[str, Any] = {"d": op.d, "at": time.time(), "ok": False, "moved": None,
                               "error": None}
        self.cancels.append(rec)
        if target is None or target["trigger_id"] is None:
            rec["error"] = "skipped: its deferral did not return a trigger id"
            return
        assert self.b.client is not None
        try:
            rec["moved"] = await asyncio.wait_for(
                self.b.client.cancel([target["trigger_id"]]), TIMEOUT)
            rec["ok"] = True
        except Exception as exc:
            rec["error"] = repr(exc)[:300]


async def _drain(b: Bench, queues: dict[str, str], work: Workload) -> bool:
    """Until nothing is deferred, no trigger row is left (but a quarantined one) and the
    queues are empty (the dead-letter queue is the checker's to judge: bad input lands there)."""
    assert b.broker is not None
    last_due = max((d["due"] for d in work.deferrals.values()), default=time.time())
    deadline = max(time.time(), last_due) + DRAIN
    while time.time() < deadline:
        busy = await retry(b, lambda db: db.fetchval(
            "SELECT (SELECT count(*) FROM task_instance WHERE state = 'deferred') "
            "+ (SELECT count(*) FROM trigger WHERE quarantined_at IS NULL)"))
        try:
            waiting = await messages(b, queues)
        except Exception:  # the bench's broker connection still reconnecting after a node stop
            await asyncio.sleep(1.0)
            continue
        waiting.pop(b.broker.topology.dead_queue)
        if busy == 0 and sum(waiting.values()) == 0:
            return True
        await asyncio.sleep(1.0)
    return False


async def _final(b: Bench, queues: dict[str, str]) -> dict[str, Any]:
    triggers = await retry(b, lambda db: db.fetch(
        "SELECT id, queue, owner_id, attempt, classpath, "
        "quarantined_at IS NOT NULL AS quarantined FROM trigger ORDER BY id"))
    deferred = await retry(b, lambda db: db.fetch(
        "SELECT task_id, queue, next_kwargs->>'d' AS d, trigger_id FROM task_instance "
        "WHERE state = 'deferred'"))
    return {"triggers": [dict(r) for r in triggers], "deferred": [dict(r) for r in deferred],
            "messages": await retry(b, lambda _: messages(b, queues)),
            "dead_letters": await retry(b, lambda _: dead_letters(b))}


# Each mode and topology keeps its own latest long run (bench/results.json).
RESULT_NAMES = {("native", "single"): "chaos", ("native", "cluster"): "chaos-cluster",
                ("airflow", "single"): "chaos-airflow"}
SETUPS = {"chaos": "native mode, one PostgreSQL, one RabbitMQ node",
          "chaos-cluster": "native mode, PostgreSQL with a synchronous standby, 3 RabbitMQ nodes",
          "chaos-airflow": "Airflow mode on an Airflow 3.3.2 metadata database"}


def _record(plan: Plan, report: Report, mode: str, topology: str) -> None:
    from rich.table import Table

    from bench.results import record

    name = RESULT_NAMES[(mode, topology)]
    t = Table(title=f"Chaos ({SETUPS[name]}): seed {plan.seed}, {plan.seconds / 60:g} minutes "
              "of faults over 2 team queues (2 consumers each) and 2 writers")
    for col in ("fault kind", "caused", "bound after it ended"):
        t.add_column(col, justify="right")
    for kind, n in sorted(report.faults_by_kind.items()):
        t.add_row(kind, str(n), f"{BOUND.get(kind, 0):g} s")
    t.caption = (f"{report.deferred} deferrals: {report.applied} applied, {report.cancelled} "
                 f"cancelled, {report.superseded} superseded, {report.failed} failed "
                 f"(documented); {report.late_over} past their bound. Left after the drain: "
                 f"{report.left_triggers} trigger rows, {report.left_messages} messages (exit "
                 f"{0 if report.ok else 1}). " + (f"Bad input: {report.bad_sent} sent, "
                 f"{report.bad_refused} refused, dead-lettered or quarantined as documented. "
                 if report.bad_sent else "") + report.lines()[-1])
    record(name, [t])
