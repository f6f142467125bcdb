"""Routing policies (pure): the seam (:mod:`~balancer.policy.base`), the default block-cost policy,
the baselines and the registry (:mod:`~balancer.policy.registry`).

``make_policy(name)`` or ``POLICIES[name]()`` builds a fresh instance; see ``docs/policies.md``.
"""

from balancer.policy.base import Policy, PolicyWeights, RouteRequest
from balancer.policy.baselines import LeastLoad, PowerOfTwo, RandomChoice, RoundRobin, Session
from balancer.policy.cost import CostPolicy
from balancer.policy.registry import DEFAULT_POLICY, POLICIES, POLICY_NAMES, PolicyFactory, make_policy
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
