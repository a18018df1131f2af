"""`triggerflow demo`: the whole flow on local RabbitMQ and PostgreSQL, in one command.

Sets up schema and topology, starts a writer and one consumer per team as real CLI
processes, runs example operators that defer a mix of triggers (timers, a file that
appears, a task-end event, one that fails, one that times out) and a reference resumer that
finishes them, shows live progress and ends with a table per team and outcome.
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.live import Live
from rich.table import Table

from triggerflow.model import TaskKey
from triggerflow.sdk import TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database, ensure_database, upgrade_schema
from triggerflow.supervise import Supervisor, child_env
from triggerflow.triggers import FileTrigger
from triggerflow.wiring import make_transport
from triggerflow_demo.host import BaseOperator, Host
from triggerflow_demo.operators import TriggerOperator, WaitUntilOperator
from triggerflow_demo.triggers import FailingTrigger, TaskEndTrigger

TEAMS = ("team-ml", "team-data-eng")
FINAL = ("success", "failed", "skipped")

SUMMARY = r"""
SELECT dag_id AS team,
       CASE WHEN task_id LIKE 'wait\_%' THEN 'wait_* (timers)' ELSE task_id END AS task,
       state, count(*) AS n,
       percentile_cont(0.5) WITHIN GROUP (
           ORDER BY extract(epoch FROM event_applied_at - event_fired_at)) * 1000 AS p50_ms,
       max(extract(epoch FROM event_applied_at - event_fired_at)) * 1000 AS max_ms
FROM task_instance WHERE run_id = $1 GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
"""


def _operators(tasks: int, workdir: Path, team: str) -> dict[str, BaseOperator]:
    ops: dict[str, BaseOperator] = {
        f"wait_{i:03d}": WaitUntilOperator(f"wait_{i:03d}", seconds=1 + (i % 5), queue=team)
        for i in range(tasks)
    }
    ops["file_lands"] = TriggerOperator(
        "file_lands", FileTrigger(str(workdir / f"{team}.csv"), poke_interval=0.5), queue=team)
    ops["task_end"] = TriggerOperator(
        "task_end", TaskEndTrigger(delay=1.5, xcoms={"rows_loaded": 1234}), queue=team)
    ops["fails"] = TriggerOperator("fails", FailingTrigger(delay=2, message="upstream 500"),
                                   queue=team)
    ops["times_out"] = TriggerOperator(
        "times_out", FileTrigger(str(workdir / "never.csv"), poke_interval=0.5), timeout=3,
        queue=team)
    return ops


def _where(url: str) -> str:
    """host:port/path of a URL, without its credentials."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}{parts.path.split('?')[0]}"


def run_demo(settings: Settings, tasks: int, keep_running: bool) -> int:
    return asyncio.run(_demo(settings, tasks, keep_running))


async def _demo(settings: Settings, tasks: int, keep_running: bool) -> int:
    console = Console()
    settings = settings.model_copy(update={
        "allowed_modules": ["triggerflow.triggers", "triggerflow_demo.triggers"]})
    dsn = settings.database_dsn()
    console.print(f"using the services at hand, as they are (nothing is reconfigured): "
                  f"PostgreSQL {_where(dsn)}, RabbitMQ {_where(settings.amqp_dsn())}",
                  highlight=False)
    console.print("[bold]1/4[/] schema and topology")
    try:
        await ensure_database(dsn)
        await asyncio.to_thread(upgrade_schema, dsn)
        transport = make_transport(settings, name="demo")
        await transport.connect()
        await transport.declare(list(TEAMS))
        await transport.close()
    except Exception as exc:
        console.print(f"[red]cannot reach PostgreSQL/RabbitMQ:[/] {exc}\n"
                      "Start them (`make services`) or set TRIGGERFLOW_DATABASE_URL / "
                      "TRIGGERFLOW_AMQP_URL.")
        return 1
    logdir = Path(tempfile.mkdtemp(prefix="triggerflow-demo-"))
    console.print(f"[bold]2/4[/] starting a writer and consumers for {', '.join(TEAMS)} "
                  f"(logs in {logdir})")
    supervisor = Supervisor(logdir)
    env = child_env(settings.model_copy(update={"queues": []}))
    supervisor.start("writer", env=env)
    for team in TEAMS:
        supervisor.start("consume", "--queue", team, env=env, name=f"consume-{team}")
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    workdir = Path(tempfile.mkdtemp(prefix="triggerflow-demo-files-"))
    operators: dict[tuple[str, str], BaseOperator] = {}
    keys: list[TaskKey] = []
    for team in TEAMS:
        for task_id, op in _operators(tasks, workdir, team).items():
            operators[(team, task_id)] = op
            keys.append(TaskKey(team, task_id, run_id))
    client = TriggerflowClient(settings)
    db = await Database.connect(dsn, max_size=2)
    host = Host(client, db, operators)
    stop = asyncio.Event()
    resumer = asyncio.create_task(host.resume_forever(stop))
    try:
        console.print(f"[bold]3/4[/] deferring {len(keys)} tasks; the resumer finishes them")
        await host.start(keys)
        asyncio.get_running_loop().call_later(
            2.0, lambda: [(workdir / f"{t}.csv").write_text("id\n1\n") for t in TEAMS])
        ok = await _progress(console, db, run_id, len(keys), timeout=60)
        console.print("[bold]4/4[/] summary")
        await _summary(console, db, run_id)
        if keep_running:
            console.print("processes keep running; Ctrl-C to stop")
            await _wait_for_signal()
        return 0 if ok else 1
    finally:
        stop.set()
        await resumer
        await client.close()
        await db.close()
        supervisor.stop_all(sig=signal.SIGTERM, grace=15)


async def _wait_for_signal() -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()


async def _progress(console: Console, db: Database, run_id: str, total: int,
                    timeout: float) -> bool:
    started = time.monotonic()

    async def table() -> tuple[Table, int]:
        rows = await db.fetch("SELECT dag_id, state, count(*) AS n FROM task_instance "
                              "WHERE run_id = $1 GROUP BY 1, 2", run_id)
        counts: dict[str, Counter[str]] = {team: Counter() for team in TEAMS}
        for r in rows:
            counts[r["dag_id"]][r["state"]] += r["n"]
        t = Table(title=f"progress ({time.monotonic() - started:4.1f}s)")
        states = ["deferred", "scheduled", "running", *FINAL]
        t.add_column("team")
        for s in states:
            t.add_column(s, justify="right")
        done = 0
        for team in TEAMS:
            t.add_row(team, *[str(counts[team][s]) for s in states])
            done += sum(counts[team][s] for s in FINAL)
        return t, done

    with Live(console=console, refresh_per_second=4) as live:
        while time.monotonic() - started < timeout:
            t, done = await table()
            live.update(t)
            if done >= total:
                return True
            await asyncio.sleep(0.25)
    console.print("[red]not every task finished in time[/]")
    return False


async def _summary(console: Console, db: Database, run_id: str) -> None:
    rows = await db.fetch(SUMMARY, run_id)
    t = Table(title="outcome per team (fire -> task instance updated, database clock)")
    for col in ("team", "task", "final state", "tasks", "p50 ms", "max ms"):
        t.add_column(col, justify="right" if col in ("tasks", "p50 ms", "max ms") else "left")
    for r in rows:
        colour = {"success": "green", "failed": "red", "skipped": "yellow"}.get(r["state"], "white")
        t.add_row(r["team"], r["task"], f"[{colour}]{r['state']}[/]", str(r["n"]),
                  f"{r['p50_ms'] or 0:.1f}", f"{r['max_ms'] or 0:.1f}")
    console.print(t)
    console.print("fails: the trigger raised -> resumed into __fail__ -> failed; "
                  "times_out: 3 s timeout -> __fail__ -> failed; task_end: ended by a "
                  "TaskSuccessEvent without a worker.")
