"""deploy/kubernetes/ is the Helm chart's rendered example, current and complete for kubectl.

triggerflow.yaml is deploy/helm/triggerflow rendered with deploy/helm/examples/native.yaml
(the chart itself is checked in test_helm.py); this file checks that it is a fresh render,
that ``kubectl kustomize`` builds it with the Secrets it reads, and that those Secrets'
examples keep each team's and the writer's credentials apart from the setup's.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests import helm_chart
from tests.manifests import by_kind, containers, secret_refs, validate, workloads

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
SECRETS = KUBE / "secrets"


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def example_secrets() -> dict[str, dict[str, str]]:
    """Secret name -> its keys and example values, from secrets/<name>/secrets.env.example."""
    out = {}
    for path in sorted(SECRETS.glob("*/secrets.env.example")):
        lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        out[path.parent.name] = dict(line.split("=", 1) for line in lines)
    return out


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What ``kubectl apply -k deploy/kubernetes`` would send (secrets.env from the examples)."""
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed: only the rendered file checked")
    copy = tmp_path_factory.mktemp("kube") / "kubernetes"
    shutil.copytree(KUBE, copy)
    for example in copy.rglob("secrets.env.example"):
        shutil.copy(example, example.with_suffix(""))
    out = subprocess.run([*command, str(copy)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_the_rendered_example_is_a_fresh_render_of_the_chart() -> None:
    """Fails when the chart or examples/native.yaml changed without `python -m tests.helm_chart`."""
    assert (KUBE / "triggerflow.yaml").read_text() == helm_chart.rendered_example()


@pytest.mark.parametrize("name", ["namespace.yaml", "triggerflow.yaml"])
def test_each_file_validates(name: str) -> None:
    for obj in load(KUBE / name):
        validate(obj)


def test_built_output_validates(built: list[dict[str, Any]]) -> None:
    kinds = sorted({o["kind"] for o in built})
    assert kinds == ["Deployment", "Job", "Namespace", "NetworkPolicy", "PodDisruptionBudget",
                     "ScaledObject", "Secret", "ServiceAccount", "TriggerAuthentication"]
    for obj in built:
        validate(obj)
        assert obj["kind"] == "Namespace" or obj["metadata"]["namespace"] == "triggerflow"


def test_every_secret_reference_resolves_to_a_generated_secret(built: list[dict[str, Any]]) -> None:
    secrets = by_kind(built, "Secret")
    references = [ref for obj in workloads(built) for c in containers(obj)
                  for ref in secret_refs(c).values()]
    for auth in by_kind(built, "TriggerAuthentication").values():
        references += [(r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]]
    assert references
    for name, key in references:
        # The generator's content hash reached the reference (a change rolls the pods).
        assert name in secrets and name.rsplit("-", 1)[0] in example_secrets(), name
        assert key in secrets[name]["data"], (name, key)


def test_the_examples_fill_exactly_the_keys_the_chart_reads() -> None:
    wanted: dict[str, set[str]] = {}
    for obj in load(KUBE / "triggerflow.yaml"):
        refs = [r for c in containers(obj) for r in secret_refs(c).values()] if obj["kind"] in (
            "Deployment", "Job") else []
        if obj["kind"] == "TriggerAuthentication":
            refs = [(r["name"], r["key"]) for r in obj["spec"]["secretTargetRef"]]
        for name, key in refs:
            wanted.setdefault(name, set()).add(key)
    assert {name: set(keys) for name, keys in example_secrets().items()} == wanted
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert {g["name"] for g in kustomization["secretGenerator"]} == wanted.keys()


def test_every_process_logs_in_as_its_own_user() -> None:
    """The setup's schema owner and admin user stay in the setup Secret; each team has its
    own database role and broker user, so row security and topic permissions apply."""
    secrets = example_secrets()
    db_users = {name: urlsplit(s["database-url"]).username for name, s in secrets.items()}
    assert len(set(db_users.values())) == len(db_users), db_users
    admin = urlsplit(secrets["triggerflow-setup"]["amqp-url"]).username
    for name, values in secrets.items():
        if name.startswith("triggerflow-team-"):
            team = name.removeprefix("triggerflow-")
            assert urlsplit(values["amqp-url"]).username == team != admin
