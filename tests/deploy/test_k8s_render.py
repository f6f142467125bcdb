"""deploy/k8s renders (Python renderer, cross-checked with ``kubectl kustomize`` when installed) and
every rendered manifest validates against the Kubernetes OpenAPI schemas (``kubernetes-validate``)."""

from __future__ import annotations

import copy
import shutil
import subprocess
from typing import Any

import kustomize_lite
import pytest
import yaml
from manifests import CRD_KINDS, K8S, OVERLAYS, rendered

try:  # kubernetes-validate ships the Kubernetes OpenAPI schemas (and needs jsonschema)
    import jsonschema
    from kubernetes_validate import utils as validate_utils
except ImportError:  # pragma: no cover - the dev extra installs it
    validate_utils = None

needs_schemas = pytest.mark.skipif(validate_utils is None, reason="pip install kubernetes-validate")

# The oldest Kubernetes the manifests support (autoscaling/v2, policy/v1, stable probes) and the newest
# schema the package ships.
SCHEMA_VERSIONS = ("1.29.0", validate_utils.latest_version() if validate_utils else "latest")

# Minimal schemas of the Prometheus operator's CRDs (their OpenAPI schemas ship with the operator, not
# with kubernetes-validate): the fields the manifests use, with their types.
_ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"}},
}
_RULE = {
    "type": "object",
    "required": ["expr"],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": "string"},
        "for": {"type": "string", "pattern": "^[0-9]+[smhd]$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "properties": {
                    "selector": {"type": "object", "required": ["matchLabels"]},
                    "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "spec": {
                "type": "object",
                "required": ["groups"],
                "properties": {
                    "groups": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "properties": {
                                "name": {"type": "string"},
                                "rules": {"type": "array", "items": _RULE},
                            },
                        },
                    }
                },
            },
        },
    },
}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_unique_namespaced_objects(overlay: str) -> None:
    resources = rendered(overlay)
    keys = [kustomize_lite.key(r) for r in resources]
    assert len(keys) == len(set(keys))
    namespace = {"dev": "kvlb-dev", "prod": "kvlb"}[overlay]
    assert {r["metadata"].get("namespace") for r in resources} == {namespace}
    kinds = {r["kind"] for r in resources}
    expected = {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap"}
    expected |= {"ServiceMonitor", "PrometheusRule", "Role", "RoleBinding", "ServiceAccount", "StatefulSet"}
    assert expected <= kinds


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_renderer_matches_kubectl_kustomize(overlay: str) -> None:
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    theirs = {kustomize_lite.key(r): r for r in yaml.safe_load_all(result.stdout) if r}
    ours = {kustomize_lite.key(r): r for r in rendered(overlay)}
    assert sorted(ours) == sorted(theirs)  # names include the generators' content hashes
    for key, resource in ours.items():
        assert resource == theirs[key], key


def test_renderer_refuses_features_it_does_not_implement(tmp_path: Any) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(kustomize_lite.Unsupported, match="commonLabels"):
        kustomize_lite.render(tmp_path)


@needs_schemas
@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_validate_against_kubernetes_schemas(overlay: str, version: str) -> None:
    checked = 0
    for resource in rendered(overlay):
        if resource["kind"] in CRD_KINDS:
            jsonschema.validate(resource, CRD_SCHEMAS[resource["kind"]])
        else:
            validate_utils.validate(resource, version, strict=True)
        checked += 1
    assert checked >= 14


@needs_schemas
def test_schema_validation_catches_mistakes() -> None:
    """The validator is strict: a misspelt field or a wrong type in a rendered manifest fails."""
    deployment = next(r for r in rendered("dev") if r["kind"] == "Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (typo, wrong_type):
        with pytest.raises(validate_utils.ValidationError):
            validate_utils.validate(broken, SCHEMA_VERSIONS[-1], strict=True)
    rule = next(r for r in rendered("dev") if r["kind"] == "PrometheusRule")
    bad_rule = copy.deepcopy(rule)
    bad_rule["spec"]["groups"][0]["rules"][0]["for"] = "soon"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_rule, CRD_SCHEMAS["PrometheusRule"])
