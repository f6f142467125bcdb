"""The ``Discovery`` seam's contract, for every discovery ``build_discovery`` makes (file, Kubernetes):
the Protocol's members, what each answers before its first run, and its over-cap counts, which the
application hands to ``kvlb_discovery_objects_over_cap_total`` whatever the discovery's kind (it
asks the discovery, it does not test for Kubernetes's class). What each does while running is in
tests/integration/test_discovery_file.py and test_discovery_kubernetes.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from balancer.config import Settings, from_mapping
from balancer.counter_collectors import DropsCollector
from balancer.discovery import Discovery, build_discovery

KINDS = ("file", "kubernetes")


def make(kind: str, tmp_path: Path) -> Discovery:
    replica_file = tmp_path / "replicas.yaml"
    replica_file.write_text("pools: []\n", "utf-8")
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text("engines\n", "utf-8")
    tree: dict[str, object] = {"file": str(replica_file)} if kind == "file" else {}
    settings = from_mapping(Settings, {"discovery": {"kind": kind, **tree}}).validate()
    discovery = build_discovery(settings, service_account_dir=account, rng=random.Random(3))
    assert discovery is not None
    return discovery


@pytest.mark.parametrize("kind", KINDS)
def test_every_discovery_has_the_protocols_members(kind: str, tmp_path: Path) -> None:
    discovery = make(kind, tmp_path)
    for member in ("run", "current", "status", "over_cap"):
        assert callable(getattr(discovery, member)), member


@pytest.mark.parametrize("kind", KINDS)
def test_before_its_first_run_a_discovery_has_found_nothing(kind: str, tmp_path: Path) -> None:
    discovery = make(kind, tmp_path)
    assert dict(discovery.current()) == {}
    status = discovery.status()
    assert status["kind"] == kind
    json.dumps(status)  # JSON-ready, for /admin


@pytest.mark.parametrize("kind", KINDS)
def test_over_cap_counts_by_bound_and_feeds_the_family(kind: str, tmp_path: Path) -> None:
    discovery = make(kind, tmp_path)
    counts = dict(discovery.over_cap())
    assert set(counts) <= {"count", "bytes"}
    assert all(isinstance(value, int) and value == 0 for value in counts.values())
    family = DropsCollector("kvlb_discovery_objects_over_cap", "test", "bound")
    family.source = discovery.over_cap  # what the application does, for any discovery
    registry = CollectorRegistry()
    registry.register(family)
    text = generate_latest(registry).decode()
    for bound in counts:
        assert f'kvlb_discovery_objects_over_cap_total{{bound="{bound}"}} 0.0' in text
    assert text.count("kvlb_discovery_objects_over_cap_total{") == len(counts)
