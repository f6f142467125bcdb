"""Turns a discovery's newest replica set into events for the application's hook (does I/O: awaits
the hook, logs).

Every discovery owns one :class:`ReplicaPublisher`. ``publish(found)`` caps the set, diffs it with
what was emitted before, and awaits the hook once per event, in order. A hook that raises is logged
and the event counts as applied: the discovery must keep watching, and the next change of that
replica emits again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from balancer.discovery.base import Discovered, Emit, ReplicaAdded, cap_replicas, diff_replicas
from balancer.types import ReplicaId

log = logging.getLogger(__name__)


class ReplicaPublisher:
    """The emitted replica set of one discovery and the counters its status shows."""

    def __init__(self, kind: str, max_replicas: int) -> None:
        self.kind = kind
        self.max_replicas = max_replicas
        self.replicas: dict[ReplicaId, Discovered] = {}
        self.added = 0
        self.removed = 0
        self.hook_errors = 0
        self.skipped_over_cap: list[ReplicaId] = []

    async def publish(self, found: Mapping[ReplicaId, Discovered], emit: Emit) -> int:
        """Emit what changed from the last published set to ``found``; returns the event count."""
        kept, over = cap_replicas(found, self.max_replicas)
        if over != self.skipped_over_cap:
            if over:
                log.warning(
                    "%s discovery: %d replica(s) over max_replicas=%d skipped (first: %s)",
                    self.kind,
                    len(over),
                    self.max_replicas,
                    over[0],
                )
            self.skipped_over_cap = over
        events = diff_replicas(self.replicas, kept)
        for event in events:
            if isinstance(event, ReplicaAdded):
                self.replicas[ReplicaId(event.replica.id)] = kept[ReplicaId(event.replica.id)]
                self.added += 1
                log.info(
                    "%s discovery: + %s (%s) %s",
                    self.kind,
                    event.replica.id,
                    event.pool_model,
                    event.replica.url,
                )
            else:
                self.replicas.pop(event.replica_id, None)
                self.removed += 1
                log.info(
                    "%s discovery: - %s (%s, %s)", self.kind, event.replica_id, event.pool_model, event.reason
                )
            try:
                await emit(event)
            except Exception:  # the hook's bug must not end discovery
                self.hook_errors += 1
                log.exception("%s discovery: the hook failed on %r", self.kind, event)
        return len(events)

    def status(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "replicas": sorted(self.replicas),
            "added": self.added,
            "removed": self.removed,
            "hook_errors": self.hook_errors,
            "skipped_over_cap": len(self.skipped_over_cap),
        }
