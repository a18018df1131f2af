"""deploy/kubernetes/ is valid and agrees with itself and with the CLI, checked offline.

Core kinds are validated against Kubernetes' own schemas (kubernetes-validate, strict: an
unknown field is an error); KEDA's kinds against the JSON schemas in
deploy/kubernetes/schemas/ (written from KEDA's CRDs). The kustomize output is built with
``kustomize`` or ``kubectl kustomize`` when either is installed; the overlays' patches are
checked against the base files either way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.test_compose import _resolve
from triggerflow.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.30.0"
SCHEMAS = {
    "ScaledObject": KUBE / "schemas" / "keda-scaledobject.schema.json",
    "TriggerAuthentication": KUBE / "schemas" / "keda-triggerauthentication.schema.json",
}
TEAMS = ["team-ml", "team-data-eng"]
# The writer waits up to 10 s for a batch on SIGTERM; the consumer hands over in < 1 s.
MIN_GRACE_SECONDS = 15


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml")
                  if p.name not in ("kustomization.yaml", "kustomizeconfig.yaml"))


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def validate(obj: dict[str, Any]) -> None:
    schema = SCHEMAS.get(obj["kind"])
    if schema is not None:
        jsonschema.Draft7Validator(json.loads(schema.read_text())).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """``kubectl apply -k deploy/kubernetes`` would send these (secrets.env from the
    examples)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: only files and patches checked")
    copy = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, copy)
    for example in copy.rglob("secrets.env.example"):
        shutil.copy(example, example.with_suffix(""))
    out = subprocess.run([*command, str(copy)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(KUBE)))
def test_each_file_validates(path: Path) -> None:
    for obj in load(path):
        validate(obj)


def test_schemas_reject_a_misspelt_field() -> None:
    """The KEDA schemas are strict enough to catch what the API server would drop."""
    (scaled,) = load(KUBE / "base" / "consumer-scaledobject.yaml")
    scaled["spec"]["triggers"][0]["metadata"]["queuename"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    (deployment,) = load(KUBE / "base" / "consumer-deployment.yaml")
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def _resolves(doc: Any, pointer: str) -> bool:
    for part in pointer.strip("/").split("/"):
        if isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        elif isinstance(doc, dict) and part in doc:
            doc = doc[part]
        else:
            return False
    return True


@pytest.mark.parametrize("team", TEAMS)
def test_overlay_patches_target_what_the_base_has(team: str) -> None:
    overlay = yaml.safe_load((KUBE / "overlays" / team / "kustomization.yaml").read_text())
    base = [o for p in (KUBE / "base").glob("consumer-*.yaml") for o in load(p)]
    assert overlay["resources"] == ["../../base"]
    assert overlay["nameSuffix"] == f"-{team}"
    for patch in overlay["patches"]:
        target = patch["target"]
        (obj,) = [o for o in base if o["kind"] == target["kind"]
                  and o["metadata"]["name"] == target["name"]]
        for op in yaml.safe_load(patch["patch"]):
            assert op["op"] == "replace" and _resolves(obj, op["path"]), op
            assert team in json.dumps(op["value"])
    assert (KUBE / "overlays" / team / "secrets.env.example").is_file()


def test_built_output_validates(built: list[dict[str, Any]]) -> None:
    kinds = sorted({o["kind"] for o in built})
    assert kinds == ["Deployment", "Job", "Namespace", "PodDisruptionBudget", "ScaledObject",
                     "Secret", "TriggerAuthentication"]
    for obj in built:
        validate(obj)


def test_each_team_has_consumers_autoscaled_on_its_own_queue(built: list[dict[str, Any]]) -> None:
    deployments = by_kind(built, "Deployment")
    auths = by_kind(built, "TriggerAuthentication")
    secrets = by_kind(built, "Secret")
    scaled = by_kind(built, "ScaledObject")
    assert len(scaled) == len(TEAMS)
    for team in TEAMS:
        so = scaled[f"triggerflow-consumer-{team}"]
        target = deployments[so["spec"]["scaleTargetRef"]["name"]]
        (container,) = target["spec"]["template"]["spec"]["containers"]
        assert container["args"] == ["consume", "--queue", team]
        rabbit, prom = so["spec"]["triggers"]
        assert rabbit["type"] == "rabbitmq" and rabbit["metadata"]["queueName"] == team
        assert prom["type"] == "prometheus"
        assert set(re.findall(r'queue="([^"]+)"', prom["metadata"]["query"])) == {team}
        auth = auths[rabbit["authenticationRef"]["name"]]
        (ref,) = auth["spec"]["secretTargetRef"]
        assert ref["parameter"] == "host"
        assert ref["key"] in secrets[ref["name"]]["data"]
        assert team in ref["name"]
        assert so["spec"]["minReplicaCount"] >= 2  # a peer takes the triggers of a pod going


def test_secret_references_resolve(built: list[dict[str, Any]]) -> None:
    secrets = by_kind(built, "Secret")
    for obj in built:
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        for container in containers(obj):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                assert ref["name"] in secrets, (obj["metadata"]["name"], ref)
                assert ref["key"] in secrets[ref["name"]]["data"] or ref.get("optional"), ref


def test_disruption_budgets_select_exactly_their_deployment(built: list[dict[str, Any]]) -> None:
    deployments = by_kind(built, "Deployment")
    budgets = by_kind(built, "PodDisruptionBudget")
    assert len(budgets) == len(deployments)
    for pdb in budgets.values():
        selector = pdb["spec"]["selector"]["matchLabels"]
        assert selector
        chosen = [name for name, d in deployments.items()
                  if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(chosen) == 1, (pdb["metadata"]["name"], chosen)
        assert pdb["spec"]["maxUnavailable"] == 1


def test_processes_stop_gracefully_and_probe_health(built: list[dict[str, Any]]) -> None:
    for name, d in by_kind(built, "Deployment").items():
        pod = d["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= MIN_GRACE_SECONDS, name
        (container,) = pod["containers"]
        kind = "writer" if container["args"] == ["writer"] else "consumer"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"] == [
                "triggerflow", "health", "--kind", kind], (name, probe)
        assert container["resources"]["requests"] and container["resources"]["limits"]
        assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_commands_flags_and_env_are_the_clis(built: list[dict[str, Any]]) -> None:
    checked = 0
    for obj in built:
        if obj["kind"] not in ("Deployment", "Job"):
            continue
        for container in containers(obj):
            _resolve(container["args"])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in container:
                    program, *argv = container[probe]["exec"]["command"]
                    assert program == "triggerflow"
                    _resolve(argv)
            names = {e["name"].removeprefix("TRIGGERFLOW_").lower()
                     for e in container.get("env", [])}
            assert names - set(Settings.model_fields) == set()
            checked += 1
    assert checked == 2 + len(TEAMS) + 1  # setup's two containers, consumers, writer


def test_setup_job_declares_every_team_queue(built: list[dict[str, Any]]) -> None:
    (job,) = by_kind(built, "Job").values()
    topology = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert topology[:2] == ["topology", "apply"]
    assert topology[2::2] == ["--queue"] * len(TEAMS) and topology[3::2] == TEAMS
    assert job["spec"]["template"]["spec"]["initContainers"][0]["args"] == ["db", "upgrade"]
