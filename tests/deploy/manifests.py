"""Shared helpers of the deploy tests: paths, rendered overlays, lookups (pure, reads files)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import kustomize_lite

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("dev", "prod")
CRD_KINDS = {"ServiceMonitor", "PrometheusRule"}

Resource = dict[str, Any]


@functools.cache
def _rendered(overlay: str) -> tuple[Resource, ...]:
    return tuple(kustomize_lite.render(K8S / "overlays" / overlay))


def rendered(overlay: str) -> list[Resource]:
    """The overlay's resources (a deep copy per call would be safer; tests only read them)."""
    return list(_rendered(overlay))


def _named(resource: Resource, name: str) -> bool:
    """The exact name, or a generated one: ``name-`` and a 10-character content hash."""
    actual: str = resource["metadata"]["name"]
    return actual == name or bool(re.fullmatch(re.escape(name) + "-[a-z0-9]{10}", actual))


def find(resources: list[Resource], kind: str, name: str | None = None) -> Resource:
    matches = [r for r in resources if r["kind"] == kind and (name is None or _named(r, name))]
    assert len(matches) == 1, (
        f"expected one {kind} {name or ''}, found {[r['metadata']['name'] for r in matches]}"
    )
    return matches[0]


def all_of(resources: list[Resource], kind: str) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind]


def container(resource: Resource, name: str) -> dict[str, Any]:
    for item in kustomize_lite.containers(resource):
        if item["name"] == name:
            return item
    raise AssertionError(f"{resource['kind']} {resource['metadata']['name']} has no container {name}")


def template_labels(resource: Resource) -> dict[str, str]:
    labels: dict[str, str] = resource["spec"]["template"]["metadata"].get("labels", {})
    return labels


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def port_of(item: dict[str, Any], name: str) -> int:
    for port in item.get("ports", []):
        if port["name"] == name:
            value: int = port["containerPort"]
            return value
    raise AssertionError(f"no port named {name}")


def arg_after(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]
