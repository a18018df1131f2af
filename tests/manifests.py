"""Offline validation of Kubernetes objects, shared by test_helm and test_kubernetes.

Core kinds go through Kubernetes' own schemas (kubernetes-validate, strict: an unknown field
is an error). KEDA's kinds go through deploy/kubernetes/schemas/keda-*.json (written from
KEDA's CRDs), the Prometheus Operator's through the openAPIV3Schema of its CRDs
(prometheus-operator-*.json), made strict here: the API server prunes fields a CRD does not
declare, so a misspelt one would vanish without a word.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

SCHEMAS = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "schemas"
K8S_VERSION = "1.30.0"
CRD_SCHEMAS = {
    "ScaledObject": "keda-scaledobject.schema.json",
    "TriggerAuthentication": "keda-triggerauthentication.schema.json",
    "PodMonitor": "prometheus-operator-podmonitor.schema.json",
    "PrometheusRule": "prometheus-operator-prometheusrule.schema.json",
}
# What every object of the CRD kinds has besides its spec (the CRD schemas leave it open).
_OBJECT_META = {"type": "object", "required": ["name"]}


def _strict(schema: Any) -> Any:
    """The CRD schema with unknown fields refused wherever the CRD does not keep them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _load(kind: str) -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())
    if kind in ("PodMonitor", "PrometheusRule"):
        schema = _strict(schema)
        schema["properties"]["metadata"] = _OBJECT_META
        schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return schema


VALIDATORS = {kind: jsonschema.Draft7Validator(_load(kind)) for kind in CRD_SCHEMAS}


def validate(obj: dict[str, Any]) -> None:
    validator = VALIDATORS.get(obj["kind"])
    if validator is not None:
        validator.validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def workloads(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in ("Deployment", "Job")]


def secret_refs(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Env var name -> (Secret, key) for every variable read from a Secret."""
    refs = {}
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            refs[env["name"]] = (ref["name"], ref["key"])
    return refs
