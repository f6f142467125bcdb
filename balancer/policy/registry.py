"""The policy registry (pure): every built-in policy by name, the weights each reads
(:data:`POLICY_WEIGHTS`), and :func:`make_policy`.

Kept apart from :mod:`balancer.policy.base` so that the seam imports no implementation: this module
imports the seam and the implementations, none of which imports it back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from balancer.errors import ConfigError
from balancer.policy.base import Policy
from balancer.policy.baselines import LeastLoad, PowerOfTwo, RandomChoice, RoundRobin, Session
from balancer.policy.cost import CostPolicy
from balancer.policy.sglang import SglangThreshold

PolicyFactory = Callable[[], Policy]

POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        "cost": CostPolicy,
        "round_robin": RoundRobin,
        "random": RandomChoice,
        "least_load": LeastLoad,
        "power_of_two": PowerOfTwo,
        "session": Session,
        "sglang_threshold": SglangThreshold,
    }
)
"""Policy name → factory of a fresh instance (read-only)."""

POLICY_WEIGHTS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "cost": frozenset(
            {
                "prefill_weight",
                "overlap_credit",
                "overlap_credit_loaded",
                "ramp_memory_s",
                "duplication_weight",
                "interference_weight",
                "admission_weight",
                "root_weight",
                "root_cap_prompts",
                "eviction_risk_weight",
                "decode_weight",
                "queue_weight",
                "temperature",
                "kv_usage_ceiling",
                "imbalance_threshold_blocks",
            }
        ),
        "round_robin": frozenset(),
        "random": frozenset(),
        "least_load": frozenset(),
        "power_of_two": frozenset(),
        "session": frozenset(),
        "sglang_threshold": frozenset({"cache_threshold", "balance_abs_threshold", "balance_rel_threshold"}),
    }
)
"""Policy name → the :class:`~balancer.policy.base.PolicyWeights` fields its decisions read (the
others change nothing it decides; ``tests/unit/test_policy_weights_read.py`` holds every policy to
it). ``kvlb tune`` sweeps only these."""

POLICY_NAMES = tuple(POLICIES)
"""Every registry name, in a stable order (the default first)."""
DEFAULT_POLICY = "cost"


def weights_read(name: str) -> frozenset[str]:
    """The weights policy ``name`` reads (:data:`POLICY_WEIGHTS`); an unknown name raises
    :class:`ConfigError`."""
    read = POLICY_WEIGHTS.get(name)
    if read is None:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return read


def make_policy(name: str) -> Policy:
    """A fresh policy by registry name; an unknown name raises :class:`ConfigError`."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory()
