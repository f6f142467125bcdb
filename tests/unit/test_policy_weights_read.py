"""Every policy reads no weight beyond the ones the registry declares for it (``POLICY_WEIGHTS``):
a weight it does not declare, set to values far from its default, changes none of its decisions on
a spread of fleets. ``kvlb tune`` relies on it to refuse a grid the policy does not read."""

from __future__ import annotations

import dataclasses
import random

import pytest

from balancer.errors import ConfigError
from balancer.load.tracker import LoadSnapshot, ReplicaLoad
from balancer.policy import POLICIES, POLICY_NAMES, PolicyWeights, RouteRequest, make_policy
from balancer.policy.base import OPTIONAL_WEIGHTS, WEIGHT_RANGES
from balancer.policy.registry import POLICY_WEIGHTS, weights_read
from balancer.types import Decision, Overlap, ReplicaId

BLOCK = 16
FIELDS = {f.name for f in dataclasses.fields(PolicyWeights)}


def _values(name: str) -> tuple[float | None, ...]:
    """Values of weight ``name`` across its range: its ends (just inside an open one), a middle
    one, and ``None`` when it may be off."""
    span = WEIGHT_RANGES[name]
    low = span.low + (0.01 if span.low_open else 0.0)
    middle = low + (min(span.high, low + 10.0) - low) / 2
    return (low, middle, span.high) + ((None,) if name in OPTIONAL_WEIGHTS else ())


def _fleets(count: int) -> list[tuple[RouteRequest, Overlap, LoadSnapshot]]:
    """Seeded fleets of 2-5 replicas: loads, queues, KV use and overlaps of every kind."""
    rng = random.Random(11)
    fleets = []
    for n in range(count):
        replicas = tuple(ReplicaId(f"r{k}") for k in range(rng.randint(2, 5)))
        request_blocks = rng.randint(1, 64)
        loads = {
            r: ReplicaLoad(
                r,
                pending_prefill_seqs=rng.randint(0, 4),
                pending_prefill_blocks=float(rng.randint(0, 400)),
                active_decode_seqs=rng.randint(0, 30),
                active_decode_blocks=rng.randint(0, 900),
                waiting_reqs=rng.choice((None, 0, 3, 12)),
                kv_usage=rng.choice((None, 0.2, 0.95)),
                capacity_blocks=rng.choice((None, 512.0, 4096.0)),
            )
            for r in replicas
        }
        overlap = Overlap(
            blocks={r: rng.randint(0, request_blocks) for r in replicas if rng.random() < 0.6},
            request_blocks=request_blocks,
            held_blocks={r: rng.randint(0, 4096) for r in replicas},
            held_roots={r: rng.randint(0, 9) for r in replicas},
        )
        request = RouteRequest(
            candidates=replicas,
            request_blocks=request_blocks,
            prompt_tokens=request_blocks * BLOCK,
            session_key=rng.choice((None, f"s{n % 4}")),
            rotation=n,
        )
        fleets.append((request, overlap, LoadSnapshot(now=float(n), block_size_tokens=BLOCK, replicas=loads)))
    return fleets


def _decide(name: str, weights: PolicyWeights) -> list[Decision]:
    policy = make_policy(name)
    return [policy(*fleet, weights, random.Random(k)) for k, fleet in enumerate(_fleets(60))]


def test_the_registry_declares_every_policy_with_real_weight_names() -> None:
    assert set(POLICY_WEIGHTS) == set(POLICIES)
    for name, read in POLICY_WEIGHTS.items():
        assert read <= FIELDS, name
        assert weights_read(name) == read
    with pytest.raises(ConfigError):
        weights_read("nope")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_weight_a_policy_does_not_declare_changes_none_of_its_decisions(name: str) -> None:
    base = _decide(name, PolicyWeights())
    for weight in sorted(FIELDS - POLICY_WEIGHTS[name]):
        for value in _values(weight):
            assert _decide(name, PolicyWeights().replace(**{weight: value})) == base, (weight, value)


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if POLICY_WEIGHTS[n]])
def test_a_policy_that_declares_weights_is_moved_by_one_of_them(name: str) -> None:
    base = _decide(name, PolicyWeights())
    moved = [
        (weight, value)
        for weight in sorted(POLICY_WEIGHTS[name])
        for value in _values(weight)
        if _decide(name, PolicyWeights().replace(**{weight: value})) != base
    ]
    assert moved
