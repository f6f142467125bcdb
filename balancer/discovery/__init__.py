"""Replica discovery: static settings, a reloaded file, or Kubernetes (I/O; see each module).

:func:`build_discovery` returns the discovery the settings ask for (``None`` for ``static``: the
``pools[].replicas`` are all there is). The application (:mod:`balancer.service.lifecycle`) runs it
as one task::

    discovery = build_discovery(settings)
    if discovery is not None:
        task = asyncio.create_task(discovery.run(on_discovery_event))

and applies each :class:`ReplicaAdded` / :class:`ReplicaRemoved` in ``on_discovery_event``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

from balancer.config import Settings
from balancer.discovery.base import (
    Discovered,
    Discovery,
    DiscoveryEvent,
    Emit,
    ReplicaAdded,
    ReplicaRemoved,
    diff_replicas,
)
from balancer.discovery.file import FileDiscovery
from balancer.discovery.kube_api import SERVICE_ACCOUNT_DIR
from balancer.errors import ConfigError

if TYPE_CHECKING:  # imported when asked for: a start without Kubernetes discovery skips its modules
    from balancer.discovery.kubernetes import KubernetesDiscovery

__all__ = [
    "Discovered",
    "Discovery",
    "DiscoveryEvent",
    "Emit",
    "FileDiscovery",
    "KubernetesDiscovery",
    "ReplicaAdded",
    "ReplicaRemoved",
    "build_discovery",
    "diff_replicas",
]


def __getattr__(name: str) -> Any:
    """``KubernetesDiscovery`` on first use (:func:`build_discovery` imports it for its kind only)."""
    if name == "KubernetesDiscovery":
        from balancer.discovery.kubernetes import KubernetesDiscovery

        return KubernetesDiscovery
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_discovery(
    settings: Settings,
    *,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
    rng: random.Random | None = None,
) -> Discovery | None:
    """The discovery of ``settings.discovery`` (``None`` for ``static``); raises :class:`ConfigError`
    when the Kubernetes namespace is neither configured nor readable from the service account."""
    config = settings.discovery
    if config.kind == "static":
        return None
    if config.kind == "file":
        assert config.file is not None  # validate() requires it
        return FileDiscovery(
            config.file, reload_interval_s=config.reload_interval_s, max_replicas=config.max_replicas
        )
    namespace = config.namespace
    if namespace is None:
        try:
            namespace = (service_account_dir / "namespace").read_text("utf-8").strip()
        except OSError as exc:
            raise ConfigError(
                f"discovery.namespace is not set and {service_account_dir}/namespace is unreadable "
                f"({exc.strerror}): set discovery.namespace"
            ) from None
    from balancer.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(
        config,
        namespace=namespace,
        token_file=service_account_dir / "token",
        ca_file=service_account_dir / "ca.crt",
        rng=rng,
    )
