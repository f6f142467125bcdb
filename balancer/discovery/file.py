"""File discovery: replicas listed in a YAML file, reloaded when it changes (does I/O: stat, read).

The file has the shape of the settings' ``pools`` section, replicas only::

    pools:
      - model: llama-3-8b
        replicas:
          - {id: sglang-0, url: "http://10.0.0.5:30000", engine: sglang, events: "tcp://10.0.0.5:5557"}

Every ``reload_interval_s`` the file's (mtime, size, inode) is compared with the last one read; a
change reads and validates it, then emits the difference. The inode matters for a Kubernetes
ConfigMap volume, which swaps a symlink rather than rewriting the file. A file that cannot be read
or does not validate keeps the last good set (and is logged once per change); so does a file with
nothing in it (no bytes, or only blanks and comments), which is what a reader sees between the
truncation and the write of ``cat > file``; an explicit empty ``pools: []`` list removes every
replica the file had added.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from balancer.config import PoolConfig, ReplicaConfig, Settings, from_mapping
from balancer.discovery.base import Discovered, Emit
from balancer.discovery.publisher import ReplicaPublisher
from balancer.errors import ConfigError
from balancer.types import ReplicaId

log = logging.getLogger(__name__)

FileSignature = tuple[int, int, int]
"""(mtime in ns, size in bytes, inode) of the replica file."""


def parse_replica_file(text: str, where: str = "replica file") -> dict[ReplicaId, Discovered]:
    """The replicas of a replica file's text (pure); raises :class:`ConfigError` naming the fault."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where} is not valid YAML: {exc}") from None
    if raw is None:  # no bytes, blanks or comments: a file being written (truncated first), not a set
        raise ConfigError(
            f"{where} is empty (a write in progress?); to remove every replica write: pools: []"
        )
    if not isinstance(raw, Mapping) or set(raw) != {"pools"}:
        raise ConfigError(f"{where}: top level must be a mapping with one key, pools")
    pools_raw = raw["pools"] or []
    if not isinstance(pools_raw, list):
        raise ConfigError(f"{where}: pools must be a list")
    pools: list[PoolConfig] = []
    for position, pool in enumerate(pools_raw):
        if not isinstance(pool, Mapping) or not set(pool) <= {"model", "replicas"} or "model" not in pool:
            raise ConfigError(f"{where}: pools[{position}] must have model and replicas only")
        replicas = _replicas(pool.get("replicas") or [], f"{where}: pools[{position}].replicas")
        pools.append(PoolConfig(model=str(pool["model"]), replicas=replicas))
    Settings(pools=tuple(pools)).validate()  # ids unique, URLs, ranges: the same rules as the settings
    return {
        ReplicaId(replica.id): Discovered(pool.model, replica) for pool in pools for replica in pool.replicas
    }


def _replicas(items: Any, where: str) -> tuple[ReplicaConfig, ...]:
    if not isinstance(items, list):
        raise ConfigError(f"{where} must be a list")
    replicas = tuple(from_mapping(ReplicaConfig, item, f"{where}[{i}]") for i, item in enumerate(items))
    for i, replica in enumerate(replicas):
        if replica.api_key_file is not None or replica.api_key_env is not None:
            raise ConfigError(
                f"{where}[{i}]: a replica file names no API key (it would go unread): set the pool's"
                " api_key_file or api_key_env in kvlb's config"
            )
    return replicas


def file_signature(path: Path) -> FileSignature | None:
    """The file's (mtime ns, size, inode), following symlinks; ``None`` if it cannot be stat-ed."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size, info.st_ino


class FileDiscovery:
    """Polls one replica file and emits the changes of its replica set."""

    def __init__(self, path: str | Path, *, reload_interval_s: float = 2.0, max_replicas: int = 1024) -> None:
        if reload_interval_s <= 0:
            raise ConfigError("discovery.reload_interval_s must be > 0")
        self.path = Path(path)
        self.reload_interval_s = reload_interval_s
        self._publisher = ReplicaPublisher("file", max_replicas)
        self._signature: FileSignature | None = None
        self._loads = 0
        self._errors = 0
        self._last_error: str | None = None

    def current(self) -> Mapping[ReplicaId, Discovered]:
        return dict(self._publisher.replicas)

    def status(self) -> dict[str, object]:
        status = self._publisher.status()
        status.update(
            path=str(self.path), loads=self._loads, errors=self._errors, last_error=self._last_error
        )
        return status

    def over_cap(self) -> Mapping[str, int]:
        """Nothing: the file is read whole, no objects are kept (replicas over
        ``discovery.max_replicas`` are in :meth:`status`, ``skipped_over_cap``)."""
        return {}

    async def run(self, emit: Emit) -> None:
        """Check the file now and then every ``reload_interval_s`` until cancelled."""
        while True:
            await self.check(emit)
            await asyncio.sleep(self.reload_interval_s)

    async def check(self, emit: Emit) -> bool:
        """Reload the file if its signature changed; ``True`` when a new replica set was published."""
        signature = await asyncio.to_thread(file_signature, self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        if signature is None:
            self._fail(f"cannot stat {self.path}; keeping {len(self._publisher.replicas)} replica(s)")
            return False
        try:
            text = await asyncio.to_thread(self.path.read_text, "utf-8")
            found = parse_replica_file(text, str(self.path))
        except (OSError, UnicodeDecodeError, ConfigError) as exc:
            self._fail(f"{exc}; keeping {len(self._publisher.replicas)} replica(s)")
            return False
        self._loads += 1
        self._last_error = None
        await self._publisher.publish(found, emit)
        return True

    def _fail(self, message: str) -> None:
        self._errors += 1
        self._last_error = message
        log.error("file discovery: %s", message)
