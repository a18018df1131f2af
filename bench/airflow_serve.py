"""Who serves the Airflow bench's triggers: Airflow's own ``airflow triggerer``, or
triggerflow's ``writer --airflow`` and ``consume --airflow`` as a deployment runs them
(``airflow.py``'s bursts, ``airflow_runtime.py``'s request latency)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from bench.airflow_waiting import roles
from testbed.airflow_stack import AirflowStack
from testbed.broker import delete_queues

QUEUE = "team-bench"


@dataclass(frozen=True)
class Served:
    """Who serves the triggers: the process whose memory is measured (the one holding the
    waiting triggers) and the query counting the triggers it holds."""

    name: str
    process: str
    held_sql: str


AIRFLOW_TRIGGERER = Served("airflow triggerer", "triggerer",
                           "SELECT count(*) FROM trigger WHERE triggerer_id IS NOT NULL")
TRIGGERFLOW = Served("triggerflow", "tf-consume",
                     "SELECT count(*) FROM triggerflow.trigger_state WHERE owner_id IS NOT NULL")


def serve_with_airflow_triggerer(stack: AirflowStack) -> Served:
    """The baseline: Airflow's own triggerer on the bench queue."""
    stack.start_triggerer([QUEUE])
    return AIRFLOW_TRIGGERER


def serve_with_triggerflow(stack: AirflowStack, amqp_url: str, queue: str = QUEUE,
                           allowed_modules: list[str] | None = None,
                           scheduler: bool = False, **settings_: Any) -> Served:
    """``triggerflow airflow setup``, then ``writer --airflow`` and ``consume --airflow --queue
    team-bench`` (or ``queue``) on the stack's database (with ``stack.env``: Airflow's Fernet
    key), as a deployment runs them, shipped defaults but ``allowed_modules`` (Airflow's
    standard triggers unless given); returns once Airflow reports the triggerer healthy.
    ``scheduler``: a scheduler runs on the stack (the shipped resume delay is kept);
    ``settings_``: more settings for both processes (``capacity=...``)."""
    import os

    from triggerflow.settings import Settings

    # No hold after the deferral (airflow_resume_delay) where no scheduler runs: there is no
    # worker exit to wait for, and Airflow's triggerer, the other side, holds nothing either.
    settings = Settings(database_url=stack.database_url, amqp_url=amqp_url,
                        namespace=f"tfbenchaf{os.getpid()}",
                        allowed_modules=allowed_modules or ["airflow.providers.standard.triggers"],
                        **({} if scheduler else {"airflow_resume_delay": 0.0}), **settings_)
    env = {**stack.env, **settings.as_env(), "PYTHONUNBUFFERED": "1"}
    tf = [sys.executable, "-m", "triggerflow"]
    # The bench's queue, left by an earlier run under another namespace (another dead-letter
    # exchange), would be refused by `topology apply`.
    delete_queues(amqp_url, [queue])
    for argv in ([*tf, "airflow", "setup", "--database-url", stack.database_url],
                 [*tf, "topology", "apply", "--queue", queue]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[2:4])} failed:\n{done.stderr[-4000:]}")
    # Each process as its own database role: statements per process (airflow_waiting).
    urls = roles(stack.database_url)
    stack.spawn("tf-writer", [*tf, "writer", "--airflow"],
                {**env, "TRIGGERFLOW_DATABASE_URL": urls["tf-writer"]})
    stack.spawn(TRIGGERFLOW.process, [*tf, "consume", "--airflow", "--queue", queue],
                {**env, "TRIGGERFLOW_DATABASE_URL": urls[TRIGGERFLOW.process]})
    stack.wait_healthy(["triggerer"], 60)  # the writer's TriggererJob heartbeat
    return TRIGGERFLOW
