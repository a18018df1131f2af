"""Render the dashboard's panels for one team from a real run, as a PNG (docs/operations.md).

Starts a PostgreSQL cluster and a RabbitMQ node of its own (testbed/services.py), a writer,
two consumers for team-ml and one for team-data-eng, and a Prometheus server (``prometheus``
on PATH or unpacked by ``.ci/tools``) scraping them every 2 s. It defers a steady stream of
timers with a burst and some failing triggers, stops one consumer past its lease once, then
asks Prometheus for each panel's queries (deploy/grafana/triggerflow.json, ``$team`` =
team-ml) over the run and plots them with matplotlib, one subplot per panel. Also prints each
process's peak RSS (VmHWM), the numbers the Kubernetes resources cite.

    .venv/bin/python deploy/grafana/render_run.py [--seconds 150] [--out docs/img/dashboard-team-ml.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from testbed.services import free_port, running_services  # noqa: E402
from triggerflow.model import TaskKey  # noqa: E402
from triggerflow.sdk import Deferral, TriggerflowClient  # noqa: E402
from triggerflow.settings import Settings  # noqa: E402
from triggerflow.triggers import DateTimeTrigger  # noqa: E402
from triggerflow_demo.triggers import FailingTrigger  # noqa: E402

TEAMS = ["team-ml", "team-data-eng"]
SCRAPE = 2  # seconds
RATE_INTERVAL = f"{4 * SCRAPE}s"  # Grafana's $__rate_interval for this scrape interval


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or next(
        (str(p) for p in (ROOT / ".tools").glob("*/usr/bin/prometheus")), None)
    if found is None:
        sys.exit("prometheus not found: run .ci/tools")
    return found


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            cwd=ROOT)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(settings: Settings, seconds: float, consumer_to_stall: subprocess.Popen[bytes],
               lease_ttl: float) -> None:
    """About 200 timers/s on team-ml (a 5,000 burst a third in), 50/s on team-data-eng,
    1 % failing; one team-ml consumer stopped past its lease at two thirds."""
    start = time.monotonic()
    n = 0
    stalled = burst = False
    async with TriggerflowClient(settings) as client:
        while (elapsed := time.monotonic() - start) < seconds:
            now = datetime.now(UTC)
            batch = []
            for queue, per_second in (("team-ml", 200), ("team-data-eng", 50)):
                for _ in range(per_second):
                    n += 1
                    fire = now + timedelta(seconds=5 + (n % 20))
                    trigger = (FailingTrigger(delay=5) if n % 100 == 0
                               else DateTimeTrigger(fire))
                    batch.append(Deferral(TaskKey("render", f"t{n}", "run"), trigger, queue))
            if not burst and elapsed > seconds / 3:
                burst = True
                at = now + timedelta(seconds=10)
                for _ in range(5000):
                    n += 1
                    batch.append(Deferral(TaskKey("render", f"t{n}", "run"),
                                          DateTimeTrigger(at), "team-ml"))
            if not stalled and elapsed > 2 * seconds / 3:
                stalled = True
                consumer_to_stall.send_signal(signal.SIGSTOP)
                await asyncio.sleep(lease_ttl + 2)
                consumer_to_stall.send_signal(signal.SIGCONT)
            await client.defer_many(batch)
            await asyncio.sleep(max(0.0, 1 - (time.monotonic() - start - elapsed)))
    await asyncio.sleep(30)  # let the last timers fire and be applied


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict[str, Any]]:
    r = httpx.get(f"{prom}/api/v1/query_range",
                  params={"query": expr, "start": start, "end": end, "step": SCRAPE}, timeout=30)
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def legend(template: str, labels: dict[str, str]) -> str:
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out


def plot(prom: str, start: float, end: float, team: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads((ROOT / "deploy" / "grafana" / "triggerflow.json").read_text())
    panels = board["panels"]
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.0 * rows), sharex=True)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", RATE_INTERVAL)
                    .replace("$team", team))
            for series in query_range(prom, expr, start, end):
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) for _, v in series["values"]]
                ax.plot(xs, ys, label=legend(target["legendFormat"], series["metric"]))
        ax.set_title(panel["title"], fontsize=10)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_ylabel({"s": "seconds", "ops": "per second", "percentunit": "ratio"}.get(unit, ""))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the run")
    fig.suptitle(f"triggerflow dashboard, team {team}: Prometheus queries of "
                 "deploy/grafana/triggerflow.json over a real run", fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=150)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard-team-ml.png")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="triggerflow-render-"))
    procs: list[subprocess.Popen[bytes]] = []
    with running_services(fast=False) as services:
        db_url = f"{services.postgres.url}/triggerflow"
        settings = Settings(database_url=db_url, amqp_url=services.rabbit.url,
                            allowed_modules=["triggerflow.triggers", "triggerflow_demo.triggers"],
                            capacity=6000)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIGGERFLOW_")}
        env.update(settings.as_env())
        cli = [sys.executable, "-m", "triggerflow"]
        try:
            subprocess.run([*cli, "db", "upgrade"], env=env, check=True, cwd=ROOT)
            subprocess.run([*cli, "topology", "apply", *[a for t in TEAMS for a in ("--queue", t)]],
                           env=env, check=True, cwd=ROOT)
            targets: dict[str, int] = {}
            for name, argv in (("writer", ["writer"]),
                               ("ml-1", ["consume", "--queue", "team-ml"]),
                               ("ml-2", ["consume", "--queue", "team-ml"]),
                               ("data-eng", ["consume", "--queue", "team-data-eng"])):
                targets[name] = free_port()
                procs.append(start([*cli, *argv], {**env, "TRIGGERFLOW_METRICS_PORT":
                                                   str(targets[name])}, work / f"{name}.log"))
            prom_port = free_port()
            (work / "prometheus.yml").write_text(json.dumps({
                "global": {"scrape_interval": f"{SCRAPE}s", "evaluation_interval": f"{SCRAPE}s"},
                "scrape_configs": [{"job_name": "triggerflow", "static_configs": [
                    {"targets": [f"127.0.0.1:{p}" for p in targets.values()]}]}],
            }))
            procs.append(start([prometheus_binary(), f"--config.file={work / 'prometheus.yml'}",
                                f"--storage.tsdb.path={work / 'tsdb'}",
                                f"--web.listen-address=127.0.0.1:{prom_port}"],
                               dict(os.environ), work / "prometheus.log"))
            time.sleep(8)
            begin = time.time()
            asyncio.run(load(settings, args.seconds, procs[1], settings.lease_ttl))
            end = time.time()
            time.sleep(2 * SCRAPE)
            plot(f"http://127.0.0.1:{prom_port}", begin, end, "team-ml", args.out)
            for (name, _), proc in zip(targets.items(), procs, strict=False):
                print(f"{name}: peak RSS {peak_rss_mib(proc.pid):.1f} MiB")
            print(f"wrote {args.out} ({end - begin:.0f} s run; logs in {work})")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
