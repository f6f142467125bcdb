"""What Kubernetes discovery keeps of an object (``kept_pod``, ``kept_slice``) answers as the whole
object does: the same endpoints and annotations, for ordinary and awkward objects alike."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from balancer.discovery.k8s_objects import (
    endpoint_from_pod,
    endpoints_from_slice,
    kept_pod,
    kept_slice,
    pod_annotations,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "k8s"
PREFIX = "kvlb.io/"


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def _pods() -> list[dict[str, Any]]:
    base = load("pod-sglang-0.json")
    variants = [base]
    for change in (
        lambda p: p["status"].update(phase="Pending"),
        lambda p: p["metadata"].update(deletionTimestamp="2026-10-01T13:00:00Z"),
        lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 8000}]),
        lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 1}, {"containerPort": 2}]),
        lambda p: p["spec"]["containers"].append({"ports": [{"name": "http", "containerPort": 9}]}),
        lambda p: p["metadata"].update(annotations={"other/x": "1", PREFIX + "engine": "vllm"}),
        lambda p: p["metadata"].pop("annotations"),
        lambda p: p.pop("spec"),
    ):
        pod = copy.deepcopy(base)
        change(pod)
        variants.append(pod)
    return variants


def _slices() -> list[dict[str, Any]]:
    base = load("endpointslice-sglang.json")
    variants = [base]
    for change in (
        lambda s: s["endpoints"][0].update(conditions={"terminating": True, "ready": False}),
        lambda s: s["endpoints"][0]["targetRef"].update(kind="Node"),
        lambda s: s["endpoints"][0].update(addresses=[]),
        lambda s: s.update(ports=[{"port": 1}, {"port": 2}]),
        lambda s: s.update(ports=[{"name": "metrics", "port": 9}]),
        lambda s: s.update(addressType="FQDN"),
        lambda s: s["endpoints"].append("not an endpoint"),
        lambda s: s["endpoints"][0].update(addresses=["10.0.0.1", "10.0.0.2"]),
    ):
        slice_obj = copy.deepcopy(base)
        change(slice_obj)
        variants.append(slice_obj)
    return variants


@pytest.mark.parametrize("pod", _pods())
def test_a_kept_pod_answers_as_the_whole_pod(pod: dict[str, Any]) -> None:
    kept = kept_pod(pod, PREFIX)
    assert endpoint_from_pod(kept) == endpoint_from_pod(pod)
    assert pod_annotations(kept, PREFIX) == pod_annotations(pod, PREFIX)
    assert len(json.dumps(kept)) < len(json.dumps(pod))


@pytest.mark.parametrize("slice_obj", _slices())
def test_a_kept_slice_answers_as_the_whole_slice(slice_obj: dict[str, Any]) -> None:
    kept = kept_slice(slice_obj)
    assert endpoints_from_slice(kept) == endpoints_from_slice(slice_obj)
    assert kept["metadata"]["name"] == slice_obj["metadata"]["name"]
