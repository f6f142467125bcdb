"""The replica load gauges named by their units, and the deprecated ``kvlb_replica_load`` they replace.

Every ``kind`` the service writes into ``kvlb_replica_load`` has one gauge named
``kvlb_replica_<name>_<unit>``, set to the same value by :meth:`balancer.metrics.Metrics.set_replica_load`;
the deprecated gauge's help names each replacement; and :meth:`~balancer.metrics.Metrics.forget_replica`
removes the series of both.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import balancer
from balancer.metrics import LOAD_KIND_METRICS, LoadKind, Metrics

UNITS = ("_seqs", "_tokens", "_blocks", "_ratio")
"""The units a load figure is counted in: sequences (a request counts its OpenAI ``n``), prompt tokens,
KV blocks, a share of the KV pool."""


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("kvlb_replica_") and "replica" in s.labels
    }


def test_every_kind_written_has_a_gauge_named_by_its_unit() -> None:
    """The kinds the ``/metrics`` handler writes (read from its source) are the table's, and each
    replacement is a registered gauge whose name ends in its unit."""
    source = (Path(balancer.__file__).parent / "api" / "http.py").read_text()
    written = set(re.findall(r'set_replica_load\(replica, "(\w+)"', source))
    assert written == set(get_args(LoadKind)) == set(LOAD_KIND_METRICS)
    metrics = Metrics.create()
    registered = {name for name in metrics.registry._names_to_collectors}
    for kind, name in LOAD_KIND_METRICS.items():
        assert name in registered and name.startswith("kvlb_replica_") and name.endswith(UNITS), (kind, name)
    assert len(set(LOAD_KIND_METRICS.values())) == len(LOAD_KIND_METRICS)


def test_the_deprecated_gauge_says_so_and_names_each_replacement() -> None:
    help_text = Metrics.create().replica_load._documentation
    assert help_text.startswith("DEPRECATED") and "docs/operations.md" in help_text
    for kind, name in LOAD_KIND_METRICS.items():
        assert f"{kind} ({name})" in help_text, kind


def test_set_replica_load_sets_both_and_forget_replica_removes_both() -> None:
    metrics = Metrics.create()
    values = dict(zip(LOAD_KIND_METRICS, (3, 1, 120, 9, 2, 0.25), strict=True))
    for replica in ("r0", "r1"):
        for kind, value in values.items():
            metrics.set_replica_load(replica, kind, value)
    seen = samples(metrics)
    for replica in ("r0", "r1"):
        for kind, value in values.items():
            assert seen[("kvlb_replica_load", (("kind", kind), ("replica", replica)))] == value
            assert seen[(LOAD_KIND_METRICS[kind], (("replica", replica),))] == value
    metrics.forget_replica("r1")
    left = samples(metrics)
    assert not [key for key in left if ("replica", "r1") in key[1]], left
    assert len(left) == len(seen) // 2
