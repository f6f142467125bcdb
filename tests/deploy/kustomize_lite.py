"""A small kustomize renderer for the features deploy/k8s uses (pure Python, reads files only).

It does what ``kubectl kustomize`` does for: ``resources`` (files and directories), ``namespace``,
``configMapGenerator`` / ``secretGenerator`` (``files``, ``literals``; the content-hash name suffix,
with references renamed in pod specs), ``images``, ``replicas`` and JSON 6902 ``patches`` with a
``target``. Anything else in a kustomization raises :class:`Unsupported`, so the renderer never
silently differs from kustomize; ``test_kustomize.py`` compares both when ``kubectl`` is installed.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]
SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "configMapGenerator",
    "secretGenerator",
    "images",
    "replicas",
    "patches",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
}
POD_OWNERS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class Unsupported(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def render(directory: Path) -> list[Resource]:
    """The resources of the kustomization in ``directory``, as kustomize would emit them."""
    resources, renames = _build(directory.resolve())
    for resource in resources:
        _rename_references(resource, renames)
    return resources


def _build(directory: Path) -> tuple[list[Resource], dict[tuple[str, str], str]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise Unsupported(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    resources: list[Resource] = []
    renames: dict[tuple[str, str], str] = {}
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            child, child_renames = _build(path)
            resources += child
            renames.update(child_renames)
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for generator, kind in (("configMapGenerator", "ConfigMap"), ("secretGenerator", "Secret")):
        for spec in kustomization.get(generator, []):
            resource = _generate(directory, kind, spec)
            renames[(kind, spec["name"])] = resource["metadata"]["name"]
            resources.append(resource)
    for patch in kustomization.get("patches", []):
        _patch(directory, resources, patch)
    for image in kustomization.get("images", []):
        for resource in resources:
            _set_image(resource, image)
    for replicas in kustomization.get("replicas", []):
        for resource in resources:
            if (
                resource["kind"] in ("Deployment", "StatefulSet")
                and resource["metadata"]["name"] == replicas["name"]
            ):
                resource["spec"]["replicas"] = replicas["count"]
    namespace = kustomization.get("namespace")
    if namespace:
        for resource in resources:
            _set_namespace(resource, namespace)
    return resources, renames


def _generate(directory: Path, kind: str, spec: dict[str, Any]) -> Resource:
    unknown = set(spec) - {"name", "files", "literals", "type"}
    if unknown or spec.get("behavior", "create") != "create":
        raise Unsupported(f"{kind} generator {spec.get('name')}: unsupported fields {sorted(unknown)}")
    data: dict[str, str] = {}
    for item in spec.get("files", []):
        key, _, path = item.rpartition("=")
        data[key or Path(path).name] = (directory / path).read_text()
    for item in spec.get("literals", []):
        key, _, value = item.partition("=")
        data[key] = value
    name = spec["name"]
    resource: Resource = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}
    if kind == "Secret":
        resource["type"] = spec.get("type", "Opaque")
        resource["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    else:
        resource["data"] = data
    resource["metadata"]["name"] = f"{name}-{content_hash(resource)}"
    return resource


def content_hash(resource: Resource) -> str:
    """kustomize's name suffix: SHA-256 of the sorted, compact JSON of kind, name, type (Secrets) and
    data; its first 10 hex digits with 0, 1, 3, a and e replaced by g, h, k, m and t. kustomize v5
    looks the name up with a path that matches nothing, so the name hashed is always empty."""
    fields: dict[str, Any] = {"kind": resource["kind"], "name": "", "data": resource["data"]}
    if resource["kind"] == "Secret":
        fields["type"] = resource["type"]
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")  # as Go's encoder
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _patch(directory: Path, resources: list[Resource], patch: dict[str, Any]) -> None:
    target = patch.get("target") or {}
    text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
    operations = yaml.safe_load(text)
    if not isinstance(operations, list) or set(target) - {"kind", "name", "group", "version"} or not target:
        raise Unsupported("only JSON 6902 patches with a target (kind, name) are supported")
    matched = [
        r
        for r in resources
        if r["kind"] == target.get("kind") and r["metadata"]["name"] == target.get("name")
    ]
    if not matched:
        raise ValueError(f"patch target {target} matches no resource")
    for resource in matched:
        for operation in operations:
            _apply_operation(resource, operation)


def _apply_operation(resource: Resource, operation: dict[str, Any]) -> None:
    op, path = operation["op"], operation["path"]
    parts = [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]
    parent: Any = resource
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if op == "remove":
        del parent[int(last) if isinstance(parent, list) else last]
    elif op in ("add", "replace"):
        value = copy.deepcopy(operation["value"])
        if isinstance(parent, list):
            if last == "-":
                parent.append(value)
            elif op == "add":
                parent.insert(int(last), value)
            else:
                parent[int(last)] = value
        else:
            if op == "replace" and last not in parent:
                raise ValueError(f"replace of missing path {path}")
            parent[last] = value
    else:
        raise Unsupported(f"JSON patch op {op}")


def pod_spec(resource: Resource) -> dict[str, Any] | None:
    if resource["kind"] in POD_OWNERS:
        spec: dict[str, Any] = resource["spec"]["template"]["spec"]
        return spec
    return None


def containers(resource: Resource) -> list[dict[str, Any]]:
    spec = pod_spec(resource)
    if spec is None:
        return []
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


def _set_image(resource: Resource, image: dict[str, Any]) -> None:
    for container in containers(resource):
        name, _, _tag = container["image"].partition(":")
        if name != image["name"]:
            continue
        new = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{new}@{image['digest']}"
        else:
            container["image"] = f"{new}:{image.get('newTag', _tag or 'latest')}"


def _set_namespace(resource: Resource, namespace: str) -> None:
    if resource["kind"] in CLUSTER_SCOPED:
        return
    resource["metadata"]["namespace"] = namespace
    if resource["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        for subject in resource.get("subjects", []):
            if subject.get("kind") == "ServiceAccount":
                subject["namespace"] = namespace


def _rename_references(resource: Resource, renames: dict[tuple[str, str], str]) -> None:
    """Point pod specs at the generated (hash-suffixed) ConfigMap and Secret names."""
    spec = pod_spec(resource)
    if spec is None:
        return

    def rename(kind: str, holder: dict[str, Any], key: str) -> None:
        if holder.get(key) is not None:
            holder[key] = renames.get((kind, holder[key]), holder[key])

    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            rename("ConfigMap", volume["configMap"], "name")
        if "secret" in volume:
            rename("Secret", volume["secret"], "secretName")
    for container in containers(resource):
        for env in container.get("env", []):
            source = env.get("valueFrom") or {}
            if "configMapKeyRef" in source:
                rename("ConfigMap", source["configMapKeyRef"], "name")
            if "secretKeyRef" in source:
                rename("Secret", source["secretKeyRef"], "name")
        for env_from in container.get("envFrom", []):
            if "configMapRef" in env_from:
                rename("ConfigMap", env_from["configMapRef"], "name")
            if "secretRef" in env_from:
                rename("Secret", env_from["secretRef"], "name")


def key(resource: Resource) -> tuple[str, str, str, str]:
    meta = resource["metadata"]
    return resource["apiVersion"], resource["kind"], meta.get("namespace", ""), meta["name"]
