"""Routing policies (pure): the seam, the default block-cost policy and the baselines.

``make_policy(name)`` or ``POLICIES[name]()`` builds a fresh instance; see ``docs/policies.md``.
"""

from balancer.policy.base import (
    DEFAULT_POLICY,
    POLICIES,
    POLICY_NAMES,
    Policy,
    PolicyFactory,
    PolicyWeights,
    RouteRequest,
    make_policy,
)
from balancer.policy.baselines import LeastLoad, PowerOfTwo, RandomChoice, RoundRobin, Session
from balancer.policy.cost import CostPolicy
from balancer.policy.sglang import SglangThreshold

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "POLICY_NAMES",
    "CostPolicy",
    "LeastLoad",
    "Policy",
    "PolicyFactory",
    "PolicyWeights",
    "PowerOfTwo",
    "RandomChoice",
    "RoundRobin",
    "RouteRequest",
    "Session",
    "SglangThreshold",
    "make_policy",
]
