"""deploy/helm/triggerflow renders, lints and validates offline, in native and Airflow mode.

The chart is rendered by Helm's own Go SDK (tests/helm_chart.py) with the two example value
files, each with two teams: team-ml scaled by KEDA, team-data-eng at a fixed count. Every
object goes through the Kubernetes, KEDA and Prometheus Operator schemas (tests/manifests.py);
then the points a platform engineer's cluster would hold against it are checked one by one.
"""

from __future__ import annotations

import copy
import http.server
import json
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from testbed.services import free_port
from tests import helm_chart
from tests.manifests import by_kind, containers, pod_spec, secret_refs, validate, workloads
from tests.test_compose import _resolve
from triggerflow.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "triggerflow.json"
TEAM_GROUP = "triggerflow-teams"  # alerts.yaml's per-team rules (compose.yaml's teams)
MODES = ["native", "airflow"]
PROBE_PATHS = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}
DEFAULT_EGRESS_PORTS = {53, 5432, 5671, 5672, 15672}


@pytest.fixture(scope="module", params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def values(mode: str) -> dict[str, Any]:
    return helm_chart.merged(helm_chart.example(mode))


@pytest.fixture(scope="module")
def objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    return helm_chart.render(values)


def teams(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in values["teams"]}


def consumer(objects: list[dict[str, Any]], team: str) -> dict[str, Any]:
    return by_kind(objects, "Deployment")[f"triggerflow-consumer-{team}"]


def process(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(obj)["containers"]
    return container


def env_values(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_labels(obj: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = obj["spec"]["template"]["metadata"]["labels"]
    return labels


def with_team_rules(rules: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The rule file as the chart ships it: the per-team group's first rule once per team of
    ``values``, that team's queue in its matcher and label (no group without teams)."""
    out = copy.deepcopy(rules)
    group = next(g for g in out["groups"] if g["name"] == TEAM_GROUP)
    example, group["rules"] = group["rules"][0], []
    for team in values.get("teams", []):
        queue = team.get("queue") or team["name"]
        rule = copy.deepcopy(example)
        rule["expr"] = re.sub(r'queue="[^"]*"', f'queue="{queue}"', example["expr"])
        rule["labels"]["queue"] = queue
        group["rules"].append(rule)
    if not group["rules"]:
        out["groups"].remove(group)
    return out


def with_values(mode: str, **changes: Any) -> list[dict[str, Any]]:
    values = copy.deepcopy(helm_chart.example(mode))
    values.update(changes)
    return helm_chart.render(values)


def test_both_examples_have_one_keda_team_and_one_fixed() -> None:
    for mode in MODES:
        listed = helm_chart.example(mode)["teams"]
        assert [("keda" in t, "replicas" in t) for t in listed] == [(True, False), (False, True)]


def test_lint_is_clean(values: dict[str, Any]) -> None:
    report = helm_chart.lint(values)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_the_defaults_alone_lint_and_render_the_writer_and_setup() -> None:
    report = helm_chart.lint({})
    assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"])
    objects = helm_chart.render({})
    for obj in objects:
        validate(obj)
    assert sorted(o["metadata"]["name"] for o in workloads(objects)) == [
        "triggerflow-setup", "triggerflow-writer"]


def test_every_object_validates(objects: list[dict[str, Any]], mode: str) -> None:
    kinds = sorted({o["kind"] for o in objects})
    # the Operator's objects and the dashboard are on in the Airflow example
    extra = ["ConfigMap", "PodMonitor", "PrometheusRule"] if mode == "airflow" else []
    assert kinds == sorted(["Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget",
                            "Pod", "ScaledObject", "Service", "ServiceAccount",
                            "TriggerAuthentication", *extra])
    for obj in objects:
        validate(obj)


def test_an_upgrade_renders_the_same_objects(values: dict[str, Any],
                                             objects: list[dict[str, Any]]) -> None:
    assert helm_chart.render(values, upgrade=True) == objects


def test_schemas_refuse_a_misspelt_field() -> None:
    objects = helm_chart.render(helm_chart.example("airflow"))
    cases = [
        ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(prot="metrics")),
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update(exp="up")),
        ("ScaledObject", lambda o: o["spec"]["triggers"][0]["metadata"].update(queuename="x")),
        ("Deployment", lambda o: pod_spec(o).update(terminationGracePeriod=30)),
    ]
    for kind, misspell in cases:
        obj = copy.deepcopy(next(o for o in objects if o["kind"] == kind))
        validate(obj)
        misspell(obj)
        with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
            validate(obj)


def test_keda_owns_the_count_of_its_teams(values: dict[str, Any],
                                          objects: list[dict[str, Any]]) -> None:
    scaled = by_kind(objects, "ScaledObject")
    auths = by_kind(objects, "TriggerAuthentication")
    for name, team in teams(values).items():
        deployment = consumer(objects, name)
        so = scaled.get(deployment["metadata"]["name"])
        if "keda" not in team:
            assert so is None
            assert deployment["spec"]["replicas"] == team["replicas"]
            continue
        # A replicas field would scale the team back on every upgrade.
        assert "replicas" not in deployment["spec"]
        assert so["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert so["spec"]["minReplicaCount"] == team["keda"]["minReplicas"] >= 2
        assert so["spec"]["maxReplicaCount"] == team["keda"]["maxReplicas"]
        rabbit, prom = so["spec"]["triggers"]
        assert rabbit["type"] == "rabbitmq" and rabbit["metadata"]["queueName"] == name
        assert prom["type"] == "prometheus"
        assert set(re.findall(r'queue="([^"]+)"', prom["metadata"]["query"])) == {name}
        (ref,) = auths[rabbit["authenticationRef"]["name"]]["spec"]["secretTargetRef"]
        assert (ref["parameter"], ref["name"], ref["key"]) == (
            "host", team["amqpUrlSecret"]["name"], team["amqpUrlSecret"]["key"])


def test_every_pod_and_container_is_pod_security_restricted(objects: list[dict[str, Any]]) -> None:
    uid = int(re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))  # type: ignore[union-attr]
    for obj in workloads(objects):
        spec = pod_spec(obj)
        assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
        assert all("hostPath" not in v for v in spec["volumes"])
        assert not {"hostNetwork", "hostPID", "hostIPC"} & spec.keys()
        for container in containers(obj):
            assert container["securityContext"] == {
                "runAsNonRoot": True, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"}}, obj["metadata"]["name"]
            # The one writable path, on an emptyDir: Airflow's home lives there too.
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
            assert any(v["name"] == "tmp" and "emptyDir" in v for v in spec["volumes"])


def test_pods_run_as_their_service_account_without_a_token(objects: list[dict[str, Any]]) -> None:
    accounts = by_kind(objects, "ServiceAccount")
    assert all(sa["automountServiceAccountToken"] is False for sa in accounts.values())
    for obj in workloads(objects):
        spec = pod_spec(obj)
        assert spec["automountServiceAccountToken"] is False
        assert spec["serviceAccountName"] in accounts


def test_each_team_and_the_writer_have_their_own_database_and_broker_secrets(
        values: dict[str, Any], objects: list[dict[str, Any]], mode: str) -> None:
    setup = values["setup"]
    owner = (setup["databaseUrlSecret"]["name"], setup["databaseUrlSecret"]["key"])
    admin = (setup["amqpUrlSecret"]["name"], setup["amqpUrlSecret"]["key"])
    seen_db, seen_amqp = [], []
    for name in [*teams(values), "writer"]:
        deployment = (by_kind(objects, "Deployment")["triggerflow-writer"] if name == "writer"
                      else consumer(objects, name))
        refs = secret_refs(process(deployment))
        seen_db.append(refs["TRIGGERFLOW_DATABASE_URL"])
        seen_amqp.append(refs["TRIGGERFLOW_AMQP_URL"])
        if mode == "airflow":  # Airflow's own ORM connects as the same role
            assert refs["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] == refs["TRIGGERFLOW_DATABASE_URL"]
        if name != "writer":
            team = teams(values)[name]
            assert refs["TRIGGERFLOW_DATABASE_URL"] == (
                team["databaseUrlSecret"]["name"], team["databaseUrlSecret"]["key"])
            assert refs["TRIGGERFLOW_AMQP_URL"] != admin
    assert len(set(seen_db)) == len(seen_db) and owner not in seen_db
    assert len(set(seen_amqp[:-1])) == len(seen_amqp) - 1  # the writer may use the admin user
    # Only the setup hook holds the migration owner's URL.
    holders = {o["metadata"]["name"] for o in workloads(objects) for c in containers(o)
               if owner in secret_refs(c).values()}
    assert holders == {"triggerflow-setup"}


@pytest.mark.parametrize(("change", "refusal"), [
    (lambda v: v["teams"][1].update(databaseUrlSecret=v["setup"]["databaseUrlSecret"]),
     "migration owner"),
    (lambda v: v["teams"][1].update(databaseUrlSecret=v["teams"][0]["databaseUrlSecret"]),
     "already team-ml's"),
    (lambda v: v["teams"][0].update(amqpUrlSecret=v["setup"]["amqpUrlSecret"]), "admin broker user"),
    (lambda v: v["writer"].update(databaseUrlSecret=v["setup"]["databaseUrlSecret"]),
     "writer its own role"),
    (lambda v: v["teams"].append(copy.deepcopy(v["teams"][0])), "listed twice"),
    (lambda v: v["teams"][0].update(replicas=3), "replicas or keda, not both"),
    (lambda v: v["teams"][0].update(allowed_modules=["x"]), "additional properties"),
    (lambda v: v.update(mode="hybrid"), "/mode"),
])
def test_the_chart_refuses_values_that_break_isolation_or_scaling(change: Any, refusal: str) -> None:
    values = helm_chart.merged(helm_chart.example("native"))
    change(values)
    with pytest.raises((helm_python.HelmRenderError, helm_python.HelmValuesError), match=refusal):
        helm_chart.render(values)


def test_a_team_entry_serves_an_airflow_team_with_consume_team() -> None:
    """``airflowTeam`` renders ``consume --team`` (docs/airflow-migrate.md); Airflow mode only."""
    values = helm_chart.merged(helm_chart.example("airflow"))
    values["teams"][0]["airflowTeam"] = "ml_team"
    objects = helm_chart.render(values)
    first, second = values["teams"][0]["name"], values["teams"][1]["name"]
    assert process(consumer(objects, first))["args"] == [
        "consume", "--queue", first, "--airflow", "--team", "ml_team"]
    assert process(consumer(objects, second))["args"] == ["consume", "--queue", second, "--airflow"]
    native = helm_chart.merged(helm_chart.example("native"))
    native["teams"][0]["airflowTeam"] = "ml_team"
    with pytest.raises(helm_python.HelmRenderError, match="airflowTeam names an Airflow team"):
        helm_chart.render(native)
    values["teams"][0]["airflowTeam"] = "no"  # Airflow's team names: [a-zA-Z0-9_-]{3,50}
    with pytest.raises((helm_python.HelmRenderError, helm_python.HelmValuesError)):
        helm_chart.render(values)


def test_setup_runs_as_a_hook_before_install_and_upgrade(values: dict[str, Any],
                                                         objects: list[dict[str, Any]],
                                                         mode: str) -> None:
    (job,) = by_kind(objects, "Job").values()
    hooks = job["metadata"]["annotations"]
    assert hooks["helm.sh/hook"] == "pre-install,pre-upgrade"
    # Without it the finished Job of the last release blocks the next one.
    assert "before-hook-creation" in hooks["helm.sh/hook-delete-policy"]
    account = by_kind(objects, "ServiceAccount")[pod_spec(job)["serviceAccountName"]]
    assert account["metadata"]["annotations"]["helm.sh/hook"] == hooks["helm.sh/hook"]
    assert int(account["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(
        hooks["helm.sh/hook-weight"])
    (schema,) = pod_spec(job)["initContainers"]
    assert schema["args"] == (["airflow", "setup"] if mode == "airflow" else ["db", "upgrade"])
    (topology,) = pod_spec(job)["containers"]
    assert topology["args"] == ["topology", "apply",
                                *[a for t in teams(values) for a in ("--queue", t)]]


def test_probes_ask_the_process_over_http_on_its_metrics_port(objects: list[dict[str, Any]]) -> None:
    for obj in by_kind(objects, "Deployment").values():
        container = process(obj)
        (port,) = container["ports"]
        assert port == {"name": "metrics",
                        "containerPort": int(env_values(container)["TRIGGERFLOW_METRICS_PORT"])}
        for probe, path in PROBE_PATHS.items():
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
            assert "exec" not in container[probe]


def test_commands_flags_and_env_are_the_clis(values: dict[str, Any], objects: list[dict[str, Any]],
                                             mode: str) -> None:
    for obj in workloads(objects):
        for container in containers(obj):
            _resolve(container["args"])
            names = {e["name"] for e in container["env"]}
            ours = {n.removeprefix("TRIGGERFLOW_").lower() for n in names if n.startswith("TRIGGERFLOW_")}
            assert ours - set(Settings.model_fields) == set(), obj["metadata"]["name"]
            assert all(n.startswith(("TRIGGERFLOW_", "AIRFLOW_")) for n in names)
    deployments = by_kind(objects, "Deployment")
    writer = process(deployments["triggerflow-writer"])
    queues = list(teams(values))
    assert writer["args"] == (["writer", "--airflow", *[a for q in queues for a in ("--queue", q)]]
                              if mode == "airflow" else ["writer"])
    assert json.loads(env_values(writer)["TRIGGERFLOW_TEAM_USERS"]) == {q: q for q in queues}
    for name, team in teams(values).items():
        container = process(consumer(objects, name))
        flag = ["--airflow"] if mode == "airflow" else []
        assert container["args"] == ["consume", "--queue", name, *flag]
        assert env_values(container)["TRIGGERFLOW_ALLOWED_MODULES"] == ",".join(team["allowedModules"])


def test_airflow_mode_reads_airflows_config_and_runs_the_airflow_image(
        values: dict[str, Any], objects: list[dict[str, Any]], mode: str) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ARG EXTRAS=""' in dockerfile and "/src${EXTRAS:+[$EXTRAS]}" in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^airflow = \[", pyproject, re.MULTILINE)  # EXTRAS=airflow names it
    for obj in by_kind(objects, "Deployment").values():
        container = process(obj)
        name = obj["metadata"]["name"].removeprefix("triggerflow-consumer-")
        override = teams(values).get(name, {}).get("image")
        image = override or (values["airflow"]["image"] if mode == "airflow" else values["image"])
        assert container["image"] == f"{image['repository']}:{image['tag']}"
        names = {e["name"] for e in container["env"]}
        if mode == "native":
            assert not any(n.startswith("AIRFLOW") for n in names)
            continue
        fernet = values["airflow"]["fernetKeySecret"]
        assert secret_refs(container)["AIRFLOW__CORE__FERNET_KEY"] == (fernet["name"], fernet["key"])
        assert env_values(container)["AIRFLOW_HOME"].startswith("/tmp/")
        assert env_values(container).items() >= values["airflow"]["config"].items()


def test_network_policies_allow_only_the_database_broker_dns_and_metrics(
        objects: list[dict[str, Any]]) -> None:
    policies = list(by_kind(objects, "NetworkPolicy").values())
    for obj in workloads(objects):
        labels = pod_labels(obj)
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        (ingress,) = spec["ingress"]
        assert ingress["ports"] == [{"port": "metrics", "protocol": "TCP"}]
        ports = {p["port"] for rule in spec["egress"] for p in rule["ports"]}
        assert ports == DEFAULT_EGRESS_PORTS


def test_each_deployment_spreads_over_nodes_and_has_its_own_budget(
        objects: list[dict[str, Any]]) -> None:
    deployments = by_kind(objects, "Deployment")
    budgets = by_kind(objects, "PodDisruptionBudget")
    assert budgets.keys() == deployments.keys()
    for name, deployment in deployments.items():
        selector = deployment["spec"]["selector"]
        (term,) = pod_spec(deployment)["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"] == {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": selector}
        chosen = [n for n, d in deployments.items()
                  if selects(budgets[name]["spec"]["selector"], pod_labels(d))]
        assert chosen == [name]
        assert budgets[name]["spec"]["maxUnavailable"] == 1
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        assert pod_spec(deployment)["terminationGracePeriodSeconds"] >= 15


def test_the_operator_gets_a_pod_monitor_and_the_alerts_file_as_rules(
        values: dict[str, Any], objects: list[dict[str, Any]], mode: str) -> None:
    monitors = by_kind(objects, "PodMonitor")
    rules = by_kind(objects, "PrometheusRule")
    deployments = by_kind(objects, "Deployment").values()
    if mode == "native":  # prometheusOperator.enabled: false
        assert monitors == {} and rules == {}
        for d in deployments:
            assert d["spec"]["template"]["metadata"]["annotations"] == {
                "prometheus.io/scrape": "true", "prometheus.io/port": "9464",
                "prometheus.io/path": "/metrics"}
        return
    (monitor,) = monitors.values()
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert all(selects(monitor["spec"]["selector"], pod_labels(d)) for d in deployments)
    assert all("annotations" not in d["spec"]["template"]["metadata"] for d in deployments)
    (rule,) = rules.values()
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == with_team_rules(yaml.safe_load(ALERTS.read_text()), values)
    # TriggerflowTargetDown reads job="triggerflow" and the pod's queue label as
    # Prometheus names it (the PodMonitor copies it onto every target).
    spec = monitor["spec"]
    target_down = next(r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]
                       if r["alert"] == "TriggerflowTargetDown")
    for d in deployments:
        job = pod_labels(d)[spec["jobLabel"]]
        assert f'up{{job="{job}"}}' in target_down
    assert "triggerflow/queue" in spec["podTargetLabels"]
    assert '"triggerflow_queue"' in target_down


def test_operator_auto_renders_annotations_when_the_cluster_has_no_monitoring_api() -> None:
    values = copy.deepcopy(helm_chart.example("airflow"))
    values["prometheusOperator"]["enabled"] = "auto"
    objects = helm_chart.render(values)  # offline: the default capabilities only
    assert not by_kind(objects, "PodMonitor") and not by_kind(objects, "PrometheusRule")


def test_the_rules_are_read_from_the_alerts_file_not_a_copy(tmp_path: Path) -> None:
    """The chart's files/alerts.yaml is a link to deploy/prometheus/alerts.yaml: a changed rule
    there is a changed PrometheusRule, with nothing else edited."""
    link = helm_chart.CHART / "files" / "alerts.yaml"
    assert link.is_symlink() and link.resolve() == ALERTS.resolve()
    tree = tmp_path / "deploy"
    shutil.copytree(helm_chart.CHART, tree / "helm" / "triggerflow", symlinks=True)
    changed = yaml.safe_load(ALERTS.read_text())
    group = next(g for g in changed["groups"] if g["name"] == "triggerflow")
    group["rules"][0]["expr"] = "vector(1)"
    shutil.copytree(DASHBOARD.parent, tree / "grafana")  # the dashboard's link resolves
    (tree / "prometheus").mkdir()
    (tree / "prometheus" / "alerts.yaml").write_text(yaml.safe_dump(changed))
    with helm_python.Chart.load(tree / "helm" / "triggerflow") as chart:
        files = chart.render(helm_chart.example("airflow"), name="triggerflow")
    (rule,) = [d for d in yaml.safe_load_all(files["triggerflow/templates/monitoring.yaml"])
               if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"] == with_team_rules(changed, helm_chart.example("airflow"))


def test_a_packaged_chart_carries_the_alerts_files_content(tmp_path: Path) -> None:
    """``helm package`` follows the link: the archive holds the rules, not a dangling link."""
    with helm_python.Chart.load(helm_chart.CHART) as chart:
        archive = chart.save(tmp_path)
    with tarfile.open(archive) as tar:
        for name, source in [("alerts.yaml", ALERTS), ("triggerflow.json", DASHBOARD)]:
            member = tar.getmember(f"triggerflow/files/{name}")
            assert member.isfile()
            assert tar.extractfile(member).read() == source.read_bytes()  # type: ignore[union-attr]


def test_adding_a_team_is_one_list_entry() -> None:
    values = copy.deepcopy(helm_chart.example("native"))
    values["teams"].append({"name": "team-x", "keda": {"maxReplicas": 4},
                            "databaseUrlSecret": {"name": "triggerflow-team-x", "key": "database-url"},
                            "amqpUrlSecret": {"name": "triggerflow-team-x", "key": "amqp-url"}})
    before = helm_chart.render(helm_chart.example("native"))
    after = helm_chart.render(values)
    added = sorted((o["kind"], o["metadata"]["name"]) for o in after if o not in before)
    name = "triggerflow-consumer-team-x"
    assert added == sorted([
        ("Deployment", name), ("PodDisruptionBudget", name), ("ScaledObject", name),
        ("TriggerAuthentication", name), ("NetworkPolicy", name),
        ("Service", f"{name}-ready"),  # `helm test` asks its /readyz
        # changed: the setup declares the queue, the writer accepts its events from team-x,
        # `helm test` asks one more Service
        ("Deployment", "triggerflow-writer"), ("Job", "triggerflow-setup"),
        ("Pod", "triggerflow-test-ready")])
    assert process(consumer(after, "team-x"))["args"] == ["consume", "--queue", "team-x"]
    assert by_kind(after, "ScaledObject")[name]["spec"]["minReplicaCount"] == 2  # chart default


def test_each_team_gets_the_rule_files_team_absent_rule(mode: str) -> None:
    """alerts.yaml has TriggerflowTeamAbsent for each of compose.yaml's consumed queues; the
    chart renders one per team of the release: for the examples' teams (compose's too) the
    very rules promtool tests, for a new team the same rule naming its queue."""
    rules = yaml.safe_load(ALERTS.read_text())
    (example_group,) = [g for g in rules["groups"] if g["name"] == TEAM_GROUP]
    in_file = {r["labels"]["queue"]: r for r in example_group["rules"]}
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    consumed = {s["command"][s["command"].index("--queue") + 1] for s in compose.values()
                if s.get("command", [None])[0] == "consume"}
    assert set(in_file) == consumed
    assert all(r["alert"] == "TriggerflowTeamAbsent" for r in in_file.values())

    values = copy.deepcopy(helm_chart.example(mode))
    values["prometheusOperator"] = {"enabled": True}
    values["teams"].append({"name": "team-x", "queue": "x-queue",
                            "databaseUrlSecret": {"name": "tf-x", "key": "database-url"},
                            "amqpUrlSecret": {"name": "tf-x", "key": "amqp-url"}})
    (rule,) = by_kind(helm_chart.render(values), "PrometheusRule").values()
    (group,) = [g for g in rule["spec"]["groups"] if g["name"] == TEAM_GROUP]
    *examples, new = group["rules"]
    assert [r["labels"]["queue"] for r in examples] == [t["name"] for t in values["teams"][:-1]]
    assert examples == [in_file[r["labels"]["queue"]] for r in examples]
    assert new["expr"] == 'absent(triggerflow_triggers_running{queue="x-queue"})'
    assert new["labels"] == {"severity": "critical", "queue": "x-queue"}
    # without teams, no empty group
    (rule,) = by_kind(helm_chart.render({"prometheusOperator": {"enabled": True}}),
                      "PrometheusRule").values()
    assert TEAM_GROUP not in [g["name"] for g in rule["spec"]["groups"]]


@pytest.mark.parametrize("enabled", [False, True])
def test_the_dashboard_ships_as_a_configmap_for_grafanas_sidecar(mode: str, enabled: bool) -> None:
    assert helm_chart.merged({})["grafanaDashboard"]["enabled"] is False
    link = helm_chart.CHART / "files" / "triggerflow.json"
    assert link.is_symlink() and link.resolve() == DASHBOARD.resolve()
    maps = by_kind(with_values(mode, grafanaDashboard={"enabled": enabled}), "ConfigMap")
    if not enabled:
        assert maps == {}
        return
    (board,) = maps.values()
    validate(board)
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["data"]["triggerflow.json"] == DASHBOARD.read_text().rstrip("\n")
    assert json.loads(board["data"]["triggerflow.json"]) == json.loads(DASHBOARD.read_text())


def test_helm_test_asks_each_deployments_readyz_through_its_own_service(
        values: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    deployments = by_kind(objects, "Deployment")
    services = by_kind(objects, "Service")
    (pod,) = by_kind(objects, "Pod").values()
    port = values["metricsPort"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert len(services) == len(deployments)
    for name, service in services.items():
        hooks = service["metadata"]["annotations"]
        assert hooks["helm.sh/hook"] == "test" and int(hooks["helm.sh/hook-weight"]) < 0
        # Endpoints are the ready pods of one Deployment, none of another's.
        chosen = [d for d, obj in deployments.items()
                  if selects({"matchLabels": service["spec"]["selector"]}, pod_labels(obj))]
        assert chosen == [name.removesuffix("-ready")]
        assert service["spec"]["ports"] == [{"name": "metrics", "port": port,
                                             "targetPort": "metrics"}]
    (container,) = pod["spec"]["containers"]
    assert sorted(container["args"][1:]) == sorted(f"http://{n}:{port}/readyz" for n in services)
    assert container["command"][:2] == ["python", "-c"]
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # kubectl would run the hooks as plain objects: the rendered example leaves them out.
    assert "helm.sh/hook: test" not in helm_chart.rendered_example()


class _Readyz(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()
        self.wfile.write(b"ready" if self.status == 200 else b"lease: expired")

    def log_message(self, *args: Any) -> None:
        pass


def test_the_test_pods_script_passes_only_when_every_readyz_answers_200() -> None:
    (pod,) = by_kind(helm_chart.render(helm_chart.example("native")), "Pod").values()
    (container,) = pod["spec"]["containers"]
    script = [sys.executable, *container["command"][1:], "0"]  # one round, no waiting
    servers = []
    for status in (200, 503):
        handler = type(f"Readyz{status}", (_Readyz,), {"status": status})
        server = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    ready, unready = (f"http://127.0.0.1:{s.server_address[1]}/readyz" for s in servers)
    try:
        def run(*urls: str) -> int:
            return subprocess.run([*script, *urls], capture_output=True, timeout=60).returncode

        assert run(ready) == 0
        assert run(ready, unready) == 1
        assert run(ready, f"http://127.0.0.1:{free_port()}/readyz") == 1  # nothing listens
    finally:
        for server in servers:
            server.shutdown()


def test_with_metrics_from_set_every_policy_still_admits_the_test_pod(mode: str) -> None:
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    objects = with_values(mode, networkPolicy={"metricsFrom": [monitoring]})
    (pod,) = by_kind(objects, "Pod").values()
    for policy in by_kind(objects, "NetworkPolicy").values():
        validate(policy)
        (ingress,) = policy["spec"]["ingress"]
        peers = ingress["from"]
        assert monitoring in peers
        assert [p for p in peers if "podSelector" in p and "namespaceSelector" not in p
                and selects(p["podSelector"], pod["metadata"]["labels"])]
