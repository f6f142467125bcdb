"""What every discovery emits, the diff that produces it, and the retry backoff (pure).

A discovery keeps the set of replicas it found, as ``{replica id: Discovered}``. Whenever it learns a
new set, :func:`diff_replicas` turns *old → new* into events, removals first:

* an id that disappeared → :class:`ReplicaRemoved` (reason ``gone``);
* an id whose pool, config or instance (pod UID) changed → :class:`ReplicaRemoved` (reason
  ``changed``) then :class:`ReplicaAdded`: a restarted pod has an empty cache, so its old index
  entries must go, and its new URL or ports need new sources;
* a new id → :class:`ReplicaAdded`.

Discovery only ever adds and removes replicas it found itself; the static ``pools[].replicas`` stay.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from balancer.config import ReplicaConfig
from balancer.types import ReplicaId


@dataclass(frozen=True, slots=True)
class Discovered:
    """One replica as a discovery sees it."""

    pool_model: str
    """The pool (``pools[].model``) the replica serves."""
    config: ReplicaConfig
    instance: str = ""
    """What identifies this incarnation (a pod UID); a change means a new, empty engine."""


@dataclass(frozen=True, slots=True)
class ReplicaAdded:
    """Start routing to ``replica`` in pool ``pool_model`` (its sources, scraper and prober too)."""

    pool_model: str
    replica: ReplicaConfig


@dataclass(frozen=True, slots=True)
class ReplicaRemoved:
    """Stop routing to ``replica_id``, drop its blocks from the index and release its lease."""

    pool_model: str
    replica_id: ReplicaId
    reason: Literal["gone", "changed"] = "gone"


DiscoveryEvent = ReplicaAdded | ReplicaRemoved
Emit = Callable[[DiscoveryEvent], Awaitable[None]]
"""The application's hook: applies one event, in order; it should not raise (errors are logged)."""


class Discovery(Protocol):
    """A long-running watcher of one replica source."""

    async def run(self, emit: Emit) -> None:
        """Watch until cancelled, calling ``emit`` for every change (one call at a time)."""
        ...

    def current(self) -> Mapping[ReplicaId, Discovered]:
        """The replica set last emitted."""
        ...

    def status(self) -> dict[str, object]:
        """A JSON-ready view for ``/admin`` and logs (kind, counts, last error)."""
        ...

    def over_cap(self) -> Mapping[str, int]:
        """The objects it did not keep, by the bound that refused them (``count``, ``bytes``), for
        ``kvlb_discovery_objects_over_cap_total{bound}``, read at scrape time; empty for a discovery
        that keeps no objects of its own (the family then has no samples)."""
        ...


def diff_replicas(
    old: Mapping[ReplicaId, Discovered], new: Mapping[ReplicaId, Discovered]
) -> list[DiscoveryEvent]:
    """Events turning ``old`` into ``new``: every removal (sorted by id), then every addition."""
    removed: list[DiscoveryEvent] = []
    added: list[DiscoveryEvent] = []
    for replica_id in sorted(old):
        before = old[replica_id]
        after = new.get(replica_id)
        if after is None:
            removed.append(ReplicaRemoved(before.pool_model, replica_id, "gone"))
        elif after != before:
            removed.append(ReplicaRemoved(before.pool_model, replica_id, "changed"))
    for replica_id in sorted(new):
        before_or_none = old.get(replica_id)
        if before_or_none != new[replica_id]:
            added.append(ReplicaAdded(new[replica_id].pool_model, new[replica_id].config))
    return removed + added


def cap_replicas(
    found: Mapping[ReplicaId, Discovered], max_replicas: int
) -> tuple[dict[ReplicaId, Discovered], list[ReplicaId]]:
    """Keep the first ``max_replicas`` ids in sorted order; returns (kept, skipped ids)."""
    ids = sorted(found)
    return {rid: found[rid] for rid in ids[:max_replicas]}, ids[max_replicas:]


@dataclass(slots=True)
class Backoff:
    """Exponential backoff with jitter: ``initial_s · 2^n`` capped at ``max_s``, times 0.5..1."""

    initial_s: float
    max_s: float
    rng: random.Random
    attempts: int = field(default=0)

    def next_delay_s(self) -> float:
        base_s = min(self.max_s, self.initial_s * 2.0 ** min(self.attempts, 30))
        self.attempts += 1
        return base_s * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        self.attempts = 0
