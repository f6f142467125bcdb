"""Settings: :mod:`~balancer.config.settings` (the frozen dataclasses) and
:mod:`~balancer.config.loader` (defaults → YAML → ``KVLB_*`` environment → ``--set``; the only reader of
the environment). Import from here: ``from balancer.config import ReplicaConfig``."""

from balancer.config.loader import from_mapping, load, merge_overrides
from balancer.config.settings import (
    AuthConfig,
    ConsoleConfig,
    DiscoveryConfig,
    EngineKind,
    LimitConfig,
    ListenConfig,
    PolicyConfig,
    PoolConfig,
    RedisConfig,
    ReplicaConfig,
    Settings,
    TimeoutConfig,
    UpstreamConfig,
)

__all__ = [
    "AuthConfig",
    "ConsoleConfig",
    "DiscoveryConfig",
    "EngineKind",
    "LimitConfig",
    "ListenConfig",
    "PolicyConfig",
    "PoolConfig",
    "RedisConfig",
    "ReplicaConfig",
    "Settings",
    "TimeoutConfig",
    "UpstreamConfig",
    "from_mapping",
    "load",
    "merge_overrides",
]
