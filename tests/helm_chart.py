"""Render deploy/helm/triggerflow offline, as ``helm template`` does, with Helm's own Go SDK.

No helm binary or Go toolchain is needed: helm-python-sdk (``helm_python``) loads Helm v4's
SDK as a shared library. The tests render and lint the chart through this module, and it
writes deploy/kubernetes/triggerflow.yaml, the native example rendered for ``kubectl``:

    .venv/bin/python -m tests.helm_chart    # after changing the chart or examples/native.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "triggerflow"
EXAMPLES = ROOT / "deploy" / "helm" / "examples"
RENDERED = ROOT / "deploy" / "kubernetes" / "triggerflow.yaml"
RELEASE = NAMESPACE = "triggerflow"
KUBE_VERSION = "v1.30.0"
HEADER = f"""\
# Generated, do not edit: the chart deploy/helm/triggerflow rendered with
# deploy/helm/examples/native.yaml, as `helm template {RELEASE} deploy/helm/triggerflow
# -n {NAMESPACE} -f deploy/helm/examples/native.yaml --skip-tests` prints it. Regenerate with
# `python -m tests.helm_chart`; tests/test_kubernetes.py fails when it differs from a fresh render.
"""


def example(name: str) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    return values


def merged(values: dict[str, Any]) -> dict[str, Any]:
    """The values a release would use: the chart's defaults under ``values``."""
    with helm_python.Chart.load(CHART) as chart:
        return chart.merge_values(values)


def render_text(values: dict[str, Any], *, upgrade: bool = False, tests: bool = True) -> str:
    """Every rendered template as one multi-document stream, in template-path order; without
    the `helm test` hooks (templates/tests/) when ``tests`` is false, as ``--skip-tests``."""
    with helm_python.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE,
                             is_install=not upgrade, is_upgrade=upgrade)
    parts = []
    for path, text in sorted(files.items()):
        body = text.strip().removeprefix("---").strip()
        if not tests and "/templates/tests/" in path:
            continue
        if path.endswith(".yaml") and body:
            parts.append(f"---\n# Source: {path}\n{body}\n")
    return "".join(parts)


def render(values: dict[str, Any], *, upgrade: bool = False) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(render_text(values, upgrade=upgrade)) if doc]


def lint(values: dict[str, Any]) -> dict[str, Any]:
    return helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE,
                            kube_version=KUBE_VERSION)


def rendered_example() -> str:
    return HEADER + render_text(example("native"), tests=False)


if __name__ == "__main__":
    RENDERED.write_text(rendered_example())
    print(f"wrote {RENDERED.relative_to(ROOT)}")
