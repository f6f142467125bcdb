"""Kubernetes objects → kvlb replicas (pure: JSON dicts in, dataclasses out).

An engine pod says what it is through annotations (prefix ``kvlb.io/`` by default; see
docs/operations.md, "Discovery on Kubernetes"):

=====================  ==========  ===========================================================
annotation             required    meaning
=====================  ==========  ===========================================================
``engine``             yes         ``sglang``, ``vllm`` or ``trtllm``
``model``              no          the pool (``pools[].model``); default ``discovery.default_model``
``port``               no          HTTP port; default the EndpointSlice's (or container's) ``http``
                                   port, or its only port
``block-size``         no          tokens per KV block; default per engine (16; 32 for ``trtllm``)
``dp-size``            no          data-parallel ranks; default 1
``event-port``         no          ZMQ PUB port of rank 0 (SGLang/vLLM); absent: no events
``replay-port``        no          ZMQ replay port of rank 0; absent: gaps resync instead
``topic``              no          ZMQ topic prefix; default empty
``metrics-path``       no          scraped metrics path; default per engine
=====================  ==========  ===========================================================

The replica id is the pod's name (stable for a StatefulSet) and its instance is the pod's UID, so a
recreated pod is removed and added again. An endpoint that is terminating is left out; one that is
merely not ready stays (kvlb's own health probes keep it out of routing without dropping its blocks).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from balancer.config import PoolConfig, ReplicaConfig, Settings
from balancer.discovery.base import Discovered
from balancer.engines.registry import ENGINE_SPECS
from balancer.errors import ConfigError
from balancer.types import ReplicaId


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine pod's address as the API server reports it."""

    pod: str
    pod_uid: str
    address: str
    http_port: int | None
    """The port named ``http`` (or the only port) of the slice or pod; ``None`` if ambiguous."""


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _http_port(ports: Iterable[Any], key: str) -> int | None:
    """The port named ``http``, else the only one; ``key`` is ``port`` (slices) or ``containerPort``."""
    numbered = [p for p in ports if isinstance(p, Mapping) and isinstance(p.get(key), int)]
    named = [p[key] for p in numbered if p.get("name") == "http"]
    if named:
        return int(named[0])
    return int(numbered[0][key]) if len(numbered) == 1 else None


def endpoints_from_slice(slice_obj: Mapping[str, Any]) -> list[Endpoint]:
    """The non-terminating pod endpoints of one ``discovery.k8s.io/v1`` EndpointSlice."""
    if slice_obj.get("addressType") not in ("IPv4", "IPv6"):
        return []
    http_port = _http_port(slice_obj.get("ports") or [], "port")
    found = []
    for item in slice_obj.get("endpoints") or []:
        if not isinstance(item, Mapping):
            continue
        conditions = item.get("conditions") or {}
        if conditions.get("terminating") is True:
            continue
        ref = item.get("targetRef") or {}
        addresses = item.get("addresses") or []
        if ref.get("kind") != "Pod" or not ref.get("name") or not addresses:
            continue
        found.append(Endpoint(str(ref["name"]), str(ref.get("uid", "")), str(addresses[0]), http_port))
    return found


def endpoints_from_slices(slices: Iterable[Mapping[str, Any]]) -> list[Endpoint]:
    """Endpoints of every slice, one per pod (the first slice by name wins, e.g. IPv4 of dual-stack)."""
    by_pod: dict[str, Endpoint] = {}
    for slice_obj in sorted(slices, key=lambda s: str(_meta(s).get("name", ""))):
        for endpoint in endpoints_from_slice(slice_obj):
            by_pod.setdefault(endpoint.pod, endpoint)
    return [by_pod[name] for name in sorted(by_pod)]


def endpoint_from_pod(pod: Mapping[str, Any]) -> Endpoint | None:
    """A running, not deleted pod with an IP as an endpoint, else ``None``."""
    meta = _meta(pod)
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return None
    ports = [port for c in (pod.get("spec") or {}).get("containers") or [] for port in c.get("ports") or []]
    return Endpoint(
        str(meta.get("name", "")),
        str(meta.get("uid", "")),
        str(status["podIP"]),
        _http_port(ports, "containerPort"),
    )


def pod_annotations(pod: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The pod's annotations whose names start with ``prefix`` (all of them by default)."""
    annotations = _meta(pod).get("annotations") or {}
    if not isinstance(annotations, Mapping):
        return {}
    return {str(k): str(v) for k, v in annotations.items() if str(k).startswith(prefix)}


def _subset(value: Any, keys: Iterable[str]) -> Any:
    """``value``'s ``keys`` (those present) when it is a mapping, else ``value`` as it is (so a
    malformed object fails where it did)."""
    return {k: value[k] for k in keys if k in value} if isinstance(value, Mapping) else value


def _http_port_entry(ports: Any, key: str) -> list[dict[str, Any]] | Any:
    """``ports`` as the one entry :func:`_http_port` picks of them (none when it picks none), or as
    they are when they cannot be read."""
    try:
        port = _http_port(ports, key)
    except (TypeError, AttributeError):
        return ports
    return [] if port is None else [{"name": "http", key: port}]


def kept_slice(slice_obj: Mapping[str, Any]) -> dict[str, Any]:
    """What discovery reads of an EndpointSlice, and nothing else (pure): its name, UID, version,
    address type, the port :func:`endpoints_from_slice` picks and, per endpoint, its terminating
    condition, pod reference and first address; :func:`endpoints_from_slice` answers the same of it
    as of ``slice_obj``. A malformed part is kept as it is (so it fails where it did)."""
    endpoints = slice_obj.get("endpoints")
    if isinstance(endpoints, list):
        endpoints = [_kept_endpoint(item) for item in endpoints if isinstance(item, Mapping)]
    return {
        "metadata": _subset(_meta(slice_obj), ("name", "uid", "resourceVersion")),
        "addressType": slice_obj.get("addressType"),
        "ports": _http_port_entry(slice_obj.get("ports") or [], "port"),
        "endpoints": endpoints,
    }


def kept_pod(pod: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """What discovery reads of a pod, and nothing else (pure): its name, UID, version and deletion
    mark, its ``prefix`` annotations, phase and IP, and the port :func:`endpoint_from_pod` picks;
    :func:`endpoint_from_pod` and :func:`pod_annotations` with ``prefix`` answer the same of it as
    of ``pod``. A whole pod is mostly what kvlb does not read (managed fields, containers' images,
    environment and mounts, volumes, statuses): a few kB of JSON, several times that parsed. A
    malformed part is kept as it is (so it fails where it did)."""
    meta = _meta(pod)
    kept_meta = _subset(meta, ("name", "uid", "resourceVersion", "deletionTimestamp"))
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping):
        kept_meta["annotations"] = {k: v for k, v in annotations.items() if str(k).startswith(prefix)}
    elif annotations is not None:
        kept_meta["annotations"] = annotations
    spec = pod.get("spec") or {}
    try:
        ports = [port for c in spec.get("containers") or [] for port in c.get("ports") or []]
    except (TypeError, AttributeError):
        kept_spec = spec
    else:
        kept_spec = {"containers": [{"ports": _http_port_entry(ports, "containerPort")}]}
    return {
        "metadata": kept_meta,
        "status": _subset(pod.get("status") or {}, ("phase", "podIP")),
        "spec": kept_spec,
    }


def kept_bytes(kept: object) -> int:
    """The bytes a kept object holds, on the high side: ``sys.getsizeof`` of each dict, list, string
    and number in it, a string shared by several counted each time (``discovery.max_object_bytes``
    adds these up)."""
    total = 0
    stack = [kept]
    while stack:
        item = stack.pop()
        total += sys.getsizeof(item)
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total


def _kept_endpoint(item: Mapping[str, Any]) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    if "conditions" in item:
        kept["conditions"] = _subset(item["conditions"], ("terminating",))
    if "targetRef" in item:
        kept["targetRef"] = _subset(item["targetRef"], ("kind", "name", "uid"))
    if "addresses" in item:
        addresses = item["addresses"]
        kept["addresses"] = addresses[:1] if isinstance(addresses, list) else addresses
    return kept


def _int(annotations: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = annotations.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"annotation {name}={raw!r} is not an integer") from None


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def build_replica(
    endpoint: Endpoint, annotations: Mapping[str, str], *, prefix: str, default_model: str | None
) -> Discovered:
    """The replica of one endpoint; raises :class:`ConfigError` saying why it cannot be used."""
    engine = annotations.get(prefix + "engine")
    spec = None if engine is None else ENGINE_SPECS.get(engine)
    if spec is None:
        raise ConfigError(f"annotation {prefix}engine must be one of {list(ENGINE_SPECS)}, got {engine!r}")
    model = annotations.get(prefix + "model") or default_model
    if not model:
        raise ConfigError(f"no annotation {prefix}model and no discovery.default_model")
    port = _int(annotations, prefix + "port", endpoint.http_port)
    if port is None:
        raise ConfigError(f"no annotation {prefix}port and no port named http")
    host = _host(endpoint.address)
    event_port = _int(annotations, prefix + "event-port", None)
    replay_port = _int(annotations, prefix + "replay-port", None)
    replica = ReplicaConfig(
        id=endpoint.pod,
        url=f"http://{host}:{port}",
        engine=spec.name,
        block_size=_int(annotations, prefix + "block-size", spec.default_block_size) or 0,
        events=None if event_port is None else f"tcp://{host}:{event_port}",
        replay=None if replay_port is None else f"tcp://{host}:{replay_port}",
        topic=annotations.get(prefix + "topic", ""),
        dp_size=_int(annotations, prefix + "dp-size", 1) or 0,
        metrics_path=annotations.get(prefix + "metrics-path") or None,
    )
    Settings(pools=(PoolConfig(model, (replica,)),)).validate()  # the settings' own range checks
    return Discovered(model, replica, endpoint.pod_uid)


def build_replicas(
    endpoints: Iterable[Endpoint],
    annotations: Mapping[str, Mapping[str, str]],
    *,
    prefix: str,
    default_model: str | None,
) -> tuple[dict[ReplicaId, Discovered], dict[str, str]]:
    """(replicas by id, {pod: why it was skipped}) for endpoints whose pod annotations are known."""
    replicas: dict[ReplicaId, Discovered] = {}
    skipped: dict[str, str] = {}
    for endpoint in endpoints:
        known = annotations.get(endpoint.pod)
        if known is None:
            continue
        try:
            replicas[ReplicaId(endpoint.pod)] = build_replica(
                endpoint, known, prefix=prefix, default_model=default_model
            )
        except ConfigError as exc:
            skipped[endpoint.pod] = str(exc)
    return replicas, skipped
