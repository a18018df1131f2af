"""The Grafana dashboard and the Prometheus alert rules use only metrics and labels that a real
consumer and writer export.

One run makes every series appear (counters show up on their first increment): timers fire
and are applied, a trigger raises, an orphaned deferral times out, garbage is dead-lettered,
a stopped consumer loses its lease, and a trigger that kills its consumers is quarantined.
Then both /metrics endpoints are scraped and every expression is checked against them. With
``promtool`` (``.ci/tools`` fetches it) every expression is also parsed as PromQL.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from testbed.services import free_port
from tests.conftest import FAST, ROOT, Processes, wait_until
from tests.triggers import Killer, Raises
from triggerflow.model import TaskKey
from triggerflow.sdk import Deferral, TriggerflowClient
from triggerflow.settings import Settings
from triggerflow.store.postgres import Database
from triggerflow.transport.rabbitmq import RabbitTransport, Topology
from triggerflow.triggers import DateTimeTrigger

DASHBOARD = ROOT / "deploy" / "grafana" / "triggerflow.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
# Labels Prometheus adds to every series it scrapes (not the process's own).
TARGET_LABELS = {"instance", "job", "pod", "namespace"}
METRIC = re.compile(r"\b(triggerflow_[a-z_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)")


def dashboard_expressions() -> dict[str, str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = {f"panel {p['title']!r} {t['refId']}": t["expr"]
             for p in board["panels"] for t in p["targets"]}
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+(?:\{[^}]*\})?), (\w+)\)",
                                         var["query"]["query"]).groups()  # type: ignore[union-attr]
            exprs[f"variable ${var['name']}"] = f"max by ({label}) ({metric})"
    return exprs


def alert_expressions() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {f"alert {r['alert']}": r["expr"] for g in rules["groups"] for r in g["rules"]}


def uses(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """(metric -> labels its own matchers use, labels used in by/on/without clauses)."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # a label_replace() argument names no metric
    metrics: dict[str, set[str]] = {}
    for name, matchers in METRIC.findall(expr):
        metrics.setdefault(name, set()).update(MATCHER.findall(matchers))
    grouping = {label.strip() for group in GROUPING.findall(expr)
                for label in group.split(",") if label.strip()}
    return metrics, grouping


def missing(expr: str, exported: dict[str, set[str]]) -> list[str]:
    metrics, grouping = uses(expr)
    problems = []
    for name, labels in metrics.items():
        if name not in exported:
            problems.append(f"{name} is not exported")
            continue
        problems += [f"{name} has no label {label}" for label in labels - exported[name]]
    known = set().union(*(exported.get(m, set()) for m in metrics)) | TARGET_LABELS
    problems += [f"no metric in it has label {label}" for label in grouping - known]
    return problems


def test_expressions_name_metrics() -> None:
    """The parsing above finds what it checks (a typo in the regexes would pass everything)."""
    exprs = {**dashboard_expressions(), **alert_expressions()}
    assert len(exprs) >= 20
    # The one rule about the scrape itself reads Prometheus's `up`, no metric of ours.
    assert 'up{job="triggerflow"}' in exprs.pop("alert TriggerflowTargetDown")
    for where, expr in exprs.items():
        assert uses(expr)[0], where
    assert uses('sum by (queue) (rate(triggerflow_x_total{queue="a",kind!~"b"}[1m]))') == (
        {"triggerflow_x_total": {"queue", "kind"}}, {"queue"})


def promtool() -> str | None:
    return shutil.which("promtool") or next(
        (str(p) for p in (ROOT / ".tools").glob("*/usr/bin/promtool")), None)


def test_expressions_parse_as_promql(tmp_path: Path) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not found (.ci/tools fetches it)")
    out = subprocess.run([tool, "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    # Grafana's variables become constants; each panel query becomes a recording rule.
    rules = [{"record": f"dashboard:q{i}", "expr": expr.replace("$__rate_interval", "1m")
              .replace("$team", "team-ml")}
             for i, expr in enumerate(dashboard_expressions().values())]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


async def scrape(port: int) -> dict[str, set[str]]:
    """Sample name -> every label name seen on it."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
    exported: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, set()).update(sample.labels)
    return exported


def merged(*scrapes: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for s in scrapes:
        for name, labels in s.items():
            out.setdefault(name, set()).update(labels)
    return out


async def test_every_dashboard_and_alert_series_is_exported(
    client: TriggerflowClient, db: Database, procs: Processes, teams: list[str],
    settings: Settings, topology: Topology, tmp_path: Path,
) -> None:
    served, orphaned = teams
    writer_port, consumer_port = free_port(), free_port()
    procs.writer(metrics_port=writer_port, max_failures=2, unclaimed_grace=0.5)
    consumer = procs.consume(served, metrics_port=consumer_port)
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 2 FROM consumer WHERE expires_at > now()"), 20)

    soon = datetime.now(UTC) + timedelta(seconds=0.5)
    await client.defer_many([Deferral(TaskKey("m", f"t{i}", "r"), DateTimeTrigger(soon), served)
                             for i in range(5)])
    await client.defer(TaskKey("m", "raises", "r"), Raises(), queue=served)
    await client.defer(TaskKey("m", "orphan", "r"), DateTimeTrigger(
        datetime.now(UTC) + timedelta(hours=1)), queue=orphaned, timeout=1)
    broker = RabbitTransport(settings.amqp_dsn(), topology, name="test-garbage")
    await broker.connect()
    await broker.publish(topology.deferrals_of(served), served, b"\x00 not a wake-up")
    await broker.close()
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 7 FROM task_instance WHERE state = 'scheduled'"), 20,
        message="timers, the failure and the orphan's timeout applied")

    consumer.send_signal(signal.SIGSTOP)  # past its lease: it fences itself on waking
    await asyncio.sleep(FAST["lease_ttl"] + 1.5)
    consumer.send_signal(signal.SIGCONT)

    async def lease_lost() -> dict[str, set[str]] | None:
        found = await scrape(consumer_port)
        return found if "triggerflow_lease_lost_total" in found else None

    from_consumer = await wait_until(lease_lost, 15, interval=0.5, message="lease lost counted")

    # Two of three victims die running it; the survivor then quarantines it.
    victim_ports = [free_port() for _ in range(3)]
    victims = [procs.consume(orphaned, max_failures=2, metrics_port=port)
               for port in victim_ports]
    await wait_until(lambda: db.fetchval(
        "SELECT count(*) = 3 FROM consumer WHERE expires_at > now() AND $1 = ANY(queues)",
        orphaned), 20, message="victims registered")
    tid = await client.defer(TaskKey("m", "killer", "r"), Killer(delay=0.3), queue=orphaned,
                             timeout=3600)
    await wait_until(lambda: db.fetchval(
        "SELECT quarantined_at IS NOT NULL FROM trigger WHERE id = $1", tid), 40,
        message="killer quarantined")

    survivors = [port for port, v in zip(victim_ports, victims, strict=True) if v.poll() is None]
    assert len(survivors) == 1

    async def all_series() -> dict[str, set[str]] | None:
        found = merged(from_consumer, await scrape(consumer_port), await scrape(writer_port),
                       await scrape(survivors[0]))
        return found if "triggerflow_reaper_quarantined_total" in found else None

    exported = await wait_until(all_series, 10, interval=0.5, message="quarantine counted")
    # Airflow mode's writers alone export it (tests/test_airflow_unserved.py reads its labels).
    exported = merged(exported, {"triggerflow_unserved_triggers": {"queue", "reason", "team"}})
    await quarantined_panel_shows(survivors[0], orphaned, tmp_path)
    problems = {where: p for where, expr in {**dashboard_expressions(),
                                             **alert_expressions()}.items()
                if (p := missing(expr, exported))}
    assert problems == {}, json.dumps(problems, indent=2)
    # and the checker notices a metric or label that is not there
    assert missing('rate(triggerflow_nope_total[1m])', exported)
    assert missing('triggerflow_triggers_running{team="x"}', exported)


def panel_expr(title: str, team: str) -> str:
    board = json.loads(DASHBOARD.read_text())
    panel = next(p for p in board["panels"] if p["title"] == title)
    return str(panel["targets"][0]["expr"]).replace("$team", team)


async def quarantined_panel_shows(port: int, queue: str, tmp_path: Path) -> None:
    """The Quarantined panel's query, evaluated by promtool on the quarantine counter as the
    consumer that quarantined exports it (born at its first increment), returns it; the
    old ``increase()`` alone returned 0 for the same series."""
    from tests.test_ops import scrape as scrape_values

    tool = promtool()
    if tool is None:
        return
    found = (await scrape_values(port))["triggerflow_reaper_quarantined_total"]
    value = next(v for labels, v in found if labels == {"queue": queue})
    series = f'triggerflow_reaper_quarantined_total{{queue="{queue}",instance="c"}}'
    old = f'sum(increase(triggerflow_reaper_quarantined_total{{queue="{queue}"}}[1h]))'
    test = {"interval": "1m",
            "input_series": [{"series": series, "values": f"_ _ {value:g}x3"}],
            "promql_expr_test": [
                {"expr": panel_expr("Quarantined", queue), "eval_time": "4m",
                 "exp_samples": [{"labels": f'{{queue="{queue}"}}', "value": value}]},
                {"expr": old, "eval_time": "4m", "exp_samples": [{"labels": "{}", "value": 0}]},
            ]}
    rules, _ = alert_rules()
    out = run_rule_tests(tool, tmp_path, [test], rules)
    assert out.returncode == 0, out.stdout + out.stderr


# Each alert against series that fire it (one or more ways, with the labels it must carry)
# and a near miss that must not (one step short of its `for:`, or a healthy twin).
W = "instance"
ALERT_CASES: dict[str, dict[str, Any]] = {
    "TriggerflowNoWriter": {
        "fire": [
            ({'triggerflow_queue_consumers{queue="ns.events",instance="c"}': "1 1 0 0 0 0",
              'triggerflow_queue_subscribers{queue="ns.events",instance="c"}': "1 1 0 0 0 0"},
             "5m", [{"queue": "ns.events"}]),
            # every process gone: nothing reports the events queue
            ({'triggerflow_queue_consumers{queue="team-ml",instance="c"}': "1x5"},
             "5m", [{"queue": "events"}]),
            # a writer holds its lease but is not subscribed
            ({'triggerflow_queue_consumers{queue="ns.events",instance="c"}': "1x5",
              'triggerflow_queue_subscribers{queue="ns.events",instance="c"}': "1 1 0 0 0 0"},
             "5m", [{"queue": "ns.events"}]),
        ],
        "quiet": ({'triggerflow_queue_consumers{queue="ns.events",instance="c"}': "1 1 1 1 1 0",
                   'triggerflow_queue_subscribers{queue="ns.events",instance="c"}': "1x5"},
                  "5m"),
    },
    "TriggerflowQueueWithoutConsumer": {
        "fire": [({'triggerflow_queue_consumers{queue="team-ml",instance="w"}': "1 1 0 0 0 0",
                   'triggerflow_queue_consumers{queue="ns.events",instance="w"}': "0x5",
                   'triggerflow_queue_consumers{queue="team-data-eng",instance="w"}': "1x5"},
                  "5m", [{"queue": "team-ml"}])],
        "quiet": ({'triggerflow_queue_consumers{queue="team-ml",instance="w"}': "1 1 1 1 1 0",
                   'triggerflow_queue_consumers{queue="ns.dead",instance="w"}': "0x5"}, "5m"),
    },
    "TriggerflowConsumerNotSubscribed": {
        "fire": [({'triggerflow_queue_unsubscribed{queue="team-ml",instance="w"}': "0 1 1 1 1"},
                  "4m", [{"queue": "team-ml"}])],
        "quiet": ({'triggerflow_queue_unsubscribed{queue="team-ml",instance="w"}': "0 0 0 1 1"},
                  "4m"),
    },
    "TriggerflowOverdueDeferredTasks": {
        "fire": [
            ({'triggerflow_queue_overdue{queue="team-ml",instance="w"}': "0 3 3 3",
              'triggerflow_queue_overdue{queue="team-data-eng",instance="w"}': "0x3"},
             "3m", [{"queue": "team-ml"}]),
            # timed out by a reaper: the labelled counter is born at its first timeout
            ({'triggerflow_reaper_timed_out_total{queue="team-ml",instance="w"}': "_ _ 2 2"},
             "3m", [{"queue": "team-ml"}]),
            ({'triggerflow_reaper_timed_out_total{queue="team-ml",instance="w"}': "0x20 4 4"},
             "22m", [{"queue": "team-ml"}]),
        ],
        "quiet": ({'triggerflow_queue_overdue{queue="team-ml",instance="w"}': "0x3",
                   'triggerflow_reaper_timed_out_total{queue="team-ml",instance="w"}': "2x30"},
                  "30m"),
    },
    "TriggerflowTriggersQuarantined": {
        "fire": [  # a series born at 1: only the `unless` clause sees it
            ({'triggerflow_reaper_quarantined_total{queue="team-ml",instance="c"}': "_ _ 1 1 1"},
             "4m", [{"queue": "team-ml"}]),
            # an old series that rose: increase()
            ({'triggerflow_reaper_quarantined_total{queue="team-ml",instance="c"}': "0x65 1 1"},
             "67m", [{"queue": "team-ml"}]),
        ],
        "quiet": ({'triggerflow_reaper_quarantined_total{queue="team-ml",instance="c"}': "1x70"},
                  "70m"),
    },
    "TriggerflowLeaseFlapping": {
        "fire": [({'triggerflow_lease_lost_total{instance="c1"}': "0 1 2 2 2",
                   'triggerflow_triggers_running{instance="c1",queue="team-ml"}': "5x4",
                   'triggerflow_lease_lost_total{instance="c2"}': "0 0 1 1 1",
                   'triggerflow_triggers_running{instance="c2",queue="team-ml"}': "5x4"},
                  "4m", [{"instance": "c1", "queue": "team-ml"}])],
        "quiet": ({'triggerflow_lease_lost_total{instance="c2"}': "0 0 1 1 1",
                   'triggerflow_triggers_running{instance="c2",queue="team-ml"}': "5x4"}, "4m"),
    },
    "TriggerflowClockSkew": {
        "fire": [({'triggerflow_clock_skew_seconds{instance="c1"}': "0 300x4",
                   'triggerflow_triggers_running{instance="c1",queue="team-ml"}': "0x4",
                   'triggerflow_clock_skew_seconds{instance="c2"}': "-0.2x4",
                   'triggerflow_triggers_running{instance="c2",queue="team-ml"}': "5x4"},
                  "4m", [{"instance": "c1", "queue": "team-ml"}])],
        "quiet": ({'triggerflow_clock_skew_seconds{instance="c1"}': "0 0.5 -0.8 0.9 0.3",
                   'triggerflow_triggers_running{instance="c1",queue="team-ml"}': "5x4"},
                  "4m"),
    },
    "TriggerflowWriterLag": {
        "fire": [
            ({'triggerflow_queue_depth{queue="ns.events",instance="w"}': "0 500x8"},
             "8m", [{"queue": "ns.events"}]),
            ({'triggerflow_queue_backlog_seconds{queue="ns.events",instance="c"}':
              "0 60 120 180 240 300 360 420"}, "7m", [{"queue": "ns.events"}]),
        ],
        "quiet": ({'triggerflow_queue_depth{queue="ns.events",instance="w"}': "0 50x8",
                   'triggerflow_queue_backlog_seconds{queue="ns.events",instance="c"}':
                   "0 30 0 30 0 30 0 30 0"}, "8m"),
    },
    "TriggerflowTeamAbsent": {
        # every consumer of team-ml gone: its series end (Prometheus marks them stale when
        # the target goes); the writer still reports the queue
        "fire": [({'triggerflow_triggers_running{queue="team-ml",instance="c1"}': "3 3 stale",
                   'triggerflow_queue_consumers{queue="team-ml",instance="w"}': "1 1 0 0 0 0",
                   'triggerflow_triggers_running{queue="team-data-eng",instance="c2"}': "1x5",
                   'triggerflow_triggers_running{queue="default",instance="c3"}': "1x5"},
                  "5m", [{"queue": "team-ml"}])],
        # one consumer of team-ml left, and a gap shorter than `for:`
        "quiet": ({'triggerflow_triggers_running{queue="team-ml",instance="c1"}': "3 3 stale",
                   'triggerflow_triggers_running{queue="team-ml",instance="c4"}': "0x5",
                   'triggerflow_triggers_running{queue="team-data-eng",instance="c2"}':
                   "1 1 1 stale 1 1",
                   'triggerflow_triggers_running{queue="default",instance="c3"}': "1x5"}, "5m"),
    },
    "TriggerflowTargetDown": {
        "fire": [({'up{job="triggerflow",instance="10.0.0.7:9464",triggerflow_queue="team-ml"}':
                   "1 0 0 0 0 0",
                   'up{job="triggerflow",instance="10.0.0.8:9464"}': "1 0 0 0 0 0",
                   'up{job="triggerflow",instance="10.0.0.9:9464",triggerflow_queue="team-ml"}':
                   "1x5",
                   'up{job="node",instance="10.0.0.1:9100"}': "0x5"},
                  "5m", [{"job": "triggerflow", "instance": "10.0.0.7:9464",
                          "triggerflow_queue": "team-ml", "queue": "team-ml"},
                         {"job": "triggerflow", "instance": "10.0.0.8:9464", "queue": "events"}])],
        "quiet": ({'up{job="triggerflow",instance="10.0.0.7:9464",triggerflow_queue="team-ml"}':
                   "1 1 1 0 0 0",
                   'up{job="node",instance="10.0.0.1:9100"}': "0x5"}, "5m"),
    },
    "TriggerflowDeadLetters": {
        "fire": [
            ({'triggerflow_queue_depth{queue="ns.dead",instance="w"}': "0 0 1 1"},
             "3m", [{"queue": "ns.dead"}]),
            ({'triggerflow_messages_dead_lettered_total{reason="malformed",instance="c"}':
              "_ _ 1 1"}, "3m", [{"queue": "dead", "reason": "malformed"}]),
        ],
        "quiet": ({'triggerflow_queue_depth{queue="ns.dead",instance="w"}': "0x3",
                   'triggerflow_messages_dead_lettered_total{reason="malformed",instance="c"}':
                   "0x3"}, "3m"),
    },
    "TriggerflowUnservedTriggers": {
        # an asset watcher with no queue, no --default-queue: both writers count it
        "fire": [({'triggerflow_unserved_triggers{queue="(no queue)",reason="no-queue",instance="w1"}':
                   "0 1 1 1 1",
                   'triggerflow_unserved_triggers{queue="(no queue)",reason="no-queue",instance="w2"}':
                   "0 1 1 1 1",
                   'triggerflow_unserved_triggers{queue="team-ml",reason="no-consumer",instance="w1"}':
                   "1 0 0 0 0"},
                  "4m", [{"queue": "(no queue)", "reason": "no-queue"}])],
        # taken within its `for` (Airflow's own triggerer, a consumer starting), then just new
        "quiet": ({'triggerflow_unserved_triggers{queue="(no queue)",reason="no-queue",instance="w1"}':
                   "0 1 0 0 1"}, "4m"),
    },
}


def alert_rules() -> tuple[dict[str, Any], dict[str, str]]:
    """The rule file without annotations (read by eye in the docs), and each alert's severity."""
    rules = yaml.safe_load(ALERTS.read_text())
    severity = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations")
            severity[rule["alert"]] = rule["labels"]["severity"]
    return rules, severity


def run_rule_tests(tool: str, tmp_path: Path, tests: list[dict[str, Any]],
                   rules: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rules))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}))
    return subprocess.run([tool, "test", "rules", "tests.yaml"], capture_output=True,
                          text=True, cwd=tmp_path)


def alert_test(alert: str, series: dict[str, str], at: str,
               fired: list[dict[str, str]]) -> dict[str, Any]:
    return {"interval": "1m",
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": at, "alertname": alert,
                                 "exp_alerts": [{"exp_labels": labels} for labels in fired]}]}


def test_alerts_fire_on_their_conditions(tmp_path: Path) -> None:
    tool = promtool()
    if tool is None:
        pytest.skip("promtool not found (.ci/tools fetches it)")
    rules, severity = alert_rules()
    assert set(severity) == set(ALERT_CASES)
    tests = []
    for alert, case in ALERT_CASES.items():
        for series, at, labels in case["fire"]:
            tests.append(alert_test(alert, series, at,
                                    [{**x, "severity": severity[alert]} for x in labels]))
        quiet, at = case["quiet"]
        tests.append(alert_test(alert, quiet, at, []))
    out = run_rule_tests(tool, tmp_path, tests, rules)
    assert out.returncode == 0, out.stdout + out.stderr
    # and the harness notices an alert that does not fire when it should
    miss = alert_test("TriggerflowQueueWithoutConsumer", ALERT_CASES[
        "TriggerflowQueueWithoutConsumer"]["quiet"][0], "5m", [{"queue": "team-ml",
                                                                "severity": "critical"}])
    assert run_rule_tests(tool, tmp_path, [miss], rules).returncode != 0


RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/triggerflow/triggerflow/blob/main/docs/runbooks.md#"


def test_every_alert_links_its_runbook_section() -> None:
    """Each rule's runbook_url is the runbooks page at an anchor its headings have, and that
    section is the alert's own (``## AlertName``) and says how to confirm it."""
    from tests.test_docs import anchors

    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert len({r["alert"] for r in rules}) >= 11
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", RUNBOOKS.read_text(), re.M | re.S))
    for rule in rules:
        url = rule["annotations"].get("runbook_url", "")
        assert url.startswith(RUNBOOK_BASE), rule["alert"]
        anchor = url.removeprefix(RUNBOOK_BASE)
        assert anchor in anchors(RUNBOOKS), f"{rule['alert']}: no section for #{anchor}"
        assert anchor == rule["alert"].lower(), rule["alert"]
        assert "**Confirm:**" in sections[rule["alert"]], rule["alert"]
