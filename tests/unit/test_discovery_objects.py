"""Discovery's pure parts: the replica diff, the backoff, Kubernetes objects → replicas, settings."""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from balancer import config
from balancer.config import ReplicaConfig, Settings
from balancer.discovery import FileDiscovery, KubernetesDiscovery, build_discovery
from balancer.discovery.base import Backoff, Discovered, ReplicaAdded, ReplicaRemoved, diff_replicas
from balancer.discovery.k8s_objects import (
    Endpoint,
    build_replica,
    build_replicas,
    endpoint_from_pod,
    endpoints_from_slices,
    pod_annotations,
)
from balancer.errors import ConfigError
from balancer.types import ReplicaId

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "k8s"
PREFIX = "kvlb.io/"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def entry(rid: str, url: str, model: str = "m", instance: str = "") -> Discovered:
    return Discovered(model, ReplicaConfig(rid, url), instance)


def test_diff_orders_removals_before_additions_and_replaces_changed() -> None:
    old = {ReplicaId(r): entry(r, f"http://h/{r}") for r in ("a", "b", "c")}
    new = dict(old)
    del new[ReplicaId("a")]
    new[ReplicaId("b")] = entry("b", "http://h/b", instance="new-uid")
    new[ReplicaId("d")] = entry("d", "http://h/d", model="m2")
    assert diff_replicas(old, new) == [
        ReplicaRemoved("m", ReplicaId("a"), "gone"),
        ReplicaRemoved("m", ReplicaId("b"), "changed"),
        ReplicaAdded("m", new[ReplicaId("b")].config),
        ReplicaAdded("m2", new[ReplicaId("d")].config),
    ]
    assert diff_replicas(new, new) == []


def test_backoff_grows_to_its_cap_with_jitter_and_resets() -> None:
    backoff = Backoff(0.5, 4.0, random.Random(3))
    delays = [backoff.next_delay_s() for _ in range(8)]
    for attempt, delay in enumerate(delays):
        base = min(4.0, 0.5 * 2**attempt)
        assert base / 2 <= delay <= base
    backoff.reset()
    assert backoff.next_delay_s() <= 0.5


def test_slice_endpoints_skip_terminating_and_keep_not_ready() -> None:
    slice_obj = load("endpointslice-sglang.json")
    slice_obj["endpoints"][1]["conditions"]["terminating"] = True
    endpoints = endpoints_from_slices([slice_obj])
    assert endpoints == [Endpoint("sglang-0", "9f1c2d3e-0000-4000-8000-000000000000", "10.244.1.17", 30000)]
    slice_obj["endpoints"][1]["conditions"] = {"ready": False}
    assert [e.pod for e in endpoints_from_slices([slice_obj])] == ["sglang-0", "sglang-1"]


def test_dual_stack_slices_give_one_endpoint_per_pod_and_fqdn_is_ignored() -> None:
    v4 = load("endpointslice-sglang.json")
    v6 = copy.deepcopy(v4)
    v6["metadata"]["name"] = "sglang-engines-zz6"
    v6["addressType"] = "IPv6"
    v6["endpoints"][0]["addresses"] = ["fd00::17"]
    fqdn = copy.deepcopy(v4)
    fqdn["metadata"]["name"] = "sglang-engines-aaa"
    fqdn["addressType"] = "FQDN"
    endpoints = endpoints_from_slices([v6, fqdn, v4])
    assert [(e.pod, e.address) for e in endpoints] == [
        ("sglang-0", "10.244.1.17"),
        ("sglang-1", "10.244.2.23"),
    ]
    only_v6 = endpoints_from_slices([v6])[0]
    built = build_replica(
        only_v6, pod_annotations(load("pod-sglang-0.json")), prefix=PREFIX, default_model=None
    )
    assert built.config.url == "http://[fd00::17]:30000"
    assert built.config.events == "tcp://[fd00::17]:5557"


def test_pod_endpoint_needs_running_ip_and_no_deletion() -> None:
    pod = load("pod-sglang-0.json")
    assert endpoint_from_pod(pod) == Endpoint("sglang-0", pod["metadata"]["uid"], "10.244.1.17", 30000)
    for change in ({"status": {"phase": "Pending", "podIP": "1.2.3.4"}}, {"status": {"phase": "Running"}}):
        assert endpoint_from_pod({**pod, **change}) is None
    deleted = copy.deepcopy(pod)
    deleted["metadata"]["deletionTimestamp"] = "2026-10-01T13:00:00Z"
    assert endpoint_from_pod(deleted) is None


@pytest.mark.parametrize(
    ("annotations", "default_model", "http_port", "message"),
    [
        ({}, "m", 30000, "engine must be one of"),
        ({"engine": "sglang"}, None, 30000, "no discovery.default_model"),
        ({"engine": "sglang"}, "m", None, "no port named http"),
        ({"engine": "sglang", "dp-size": "two"}, "m", 30000, "not an integer"),
        ({"engine": "sglang", "dp-size": "65"}, "m", 30000, r"dp_size must be in \[1, 64\]"),
        ({"engine": "vllm", "block-size": "0"}, "m", 30000, "block_size"),
    ],
)
def test_bad_annotations_say_why(
    annotations: dict[str, str], default_model: str | None, http_port: int | None, message: str
) -> None:
    endpoint = Endpoint("p-0", "u", "10.0.0.1", http_port)
    with pytest.raises(ConfigError, match=message):
        build_replica(
            endpoint,
            {PREFIX + k: v for k, v in annotations.items()},
            prefix=PREFIX,
            default_model=default_model,
        )


def test_build_replicas_defaults_and_custom_prefix() -> None:
    endpoints = [
        Endpoint("t-0", "u0", "10.0.0.2", 8000),
        Endpoint("x-0", "u1", "10.0.0.3", 1),
        Endpoint("n-0", "u", "1", 1),
    ]
    annotations = {
        "t-0": {
            "acme/engine": "trtllm",
            "acme/topic": "ignored-for-trtllm",
            "acme/metrics-path": "/prometheus/metrics",
        },
        "x-0": {"acme/engine": "other"},
    }
    found, skipped = build_replicas(endpoints, annotations, prefix="acme/", default_model="pool")
    assert list(found) == ["t-0"]
    replica = found[ReplicaId("t-0")]
    assert replica == Discovered(
        "pool",
        ReplicaConfig(
            "t-0",
            "http://10.0.0.2:8000",
            "trtllm",
            32,
            topic="ignored-for-trtllm",
            metrics_path="/prometheus/metrics",
        ),
        "u0",
    )
    assert list(skipped) == ["x-0"]  # n-0's annotations are unknown: neither built nor skipped


def test_discovery_settings_validate_and_build(tmp_path: Path) -> None:
    assert build_discovery(Settings()) is None
    with pytest.raises(ConfigError, match=re.escape("discovery.file is required")):
        config.load(sets=["discovery.kind=file"], env={})
    with pytest.raises(ConfigError, match=re.escape("discovery.reload_interval_s must be > 0")):
        config.load(sets=["discovery.reload_interval_s=0"], env={})
    with pytest.raises(ConfigError, match="must be one of"):
        config.load(sets=["discovery.kind=consul"], env={})
    file_settings = config.load(sets=["discovery.kind=file", f"discovery.file={tmp_path / 'r.yaml'}"], env={})
    assert isinstance(build_discovery(file_settings), FileDiscovery)
    kube = config.load(env={"KVLB_DISCOVERY__KIND": "kubernetes"})
    with pytest.raises(ConfigError, match=re.escape("set discovery.namespace")):
        build_discovery(kube, service_account_dir=tmp_path)
    (tmp_path / "namespace").write_text("inference\n")
    built = build_discovery(kube, service_account_dir=tmp_path)
    assert isinstance(built, KubernetesDiscovery)
    assert built.collection_path == "/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
    pods = config.load(
        sets=["discovery.kind=kubernetes", "discovery.namespace=ns", "discovery.resource=pods"], env={}
    )
    built_pods = build_discovery(pods, service_account_dir=tmp_path)
    assert (
        isinstance(built_pods, KubernetesDiscovery)
        and built_pods.collection_path == "/api/v1/namespaces/ns/pods"
    )
