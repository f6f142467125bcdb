"""Settings: :mod:`~balancer.config.settings` (the frozen dataclasses) and
:mod:`~balancer.config.loader` (defaults → YAML → ``KVLB_*`` environment → ``--set``; the only reader of
the environment). Import from here: ``from balancer.config import ReplicaConfig``."""

from balancer.config.across import endpoint_for_rank
from balancer.config.loader import (
    TOKENIZERS_PARALLELISM,
    SettingsSource,
    allocator_environ,
    config_file,
    from_mapping,
    jemalloc_found,
    load,
    load_with_source,
    merge_overrides,
    one_thread_per_encode,
)
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
    SloConfig,
    TimeoutConfig,
    UpstreamConfig,
)
from balancer.config.workers import WorkersConfig

__all__ = [
    "TOKENIZERS_PARALLELISM",
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
    "SettingsSource",
    "SloConfig",
    "TimeoutConfig",
    "UpstreamConfig",
    "WorkersConfig",
    "allocator_environ",
    "config_file",
    "endpoint_for_rank",
    "from_mapping",
    "jemalloc_found",
    "load",
    "load_with_source",
    "merge_overrides",
    "one_thread_per_encode",
]
