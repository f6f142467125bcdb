"""The policy registry (pure): every built-in policy by name, and :func:`make_policy`.

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

POLICY_NAMES = tuple(POLICIES)
"""Every registry name, in a stable order (the default first)."""
DEFAULT_POLICY = "cost"


def make_policy(name: str) -> Policy:
    """A fresh policy by registry name; an unknown name raises :class:`ConfigError`."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory()
