"""The audit log of policy changes (pure): who changed what, when and why (``GET /admin/audit``).

Bounded by ``console.audit_log_size`` entries (the oldest are dropped and counted); every change is
also logged once at INFO by the admin API. In memory, per balancer: in fleet mode each balancer keeps
the changes it was asked to make and those it adopted from Redis (their actor and reason are stored
with the policy there; ``balancer.fleet.policy_sync``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_REASON_CHARS = 500
"""Longest ``reason`` accepted by ``PUT /admin/policy`` (longer → 400)."""
MAX_ACTOR_CHARS = 64
"""Longest ``x-kvlb-actor`` accepted (longer or unprintable → 400)."""
DEFAULT_ACTOR = "admin"


@dataclass(frozen=True, slots=True)
class AuditEntry:
    wall_ts: float
    actor: str
    """Who says they made the change (``x-kvlb-actor``; ``admin`` when absent)."""
    caller: str
    """Who the balancer saw: the admin token's fingerprint and the client address."""
    reason: str | None
    version: int
    """The policy version the change produced."""
    before: dict[str, Any]
    after: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "ts": self.wall_ts,
            "actor": self.actor,
            "caller": self.caller,
            "reason": self.reason,
            "version": self.version,
            "change": {"before": self.before, "after": self.after},
        }


class AuditLog:
    """The newest ``max_entries`` changes; ``on_drop`` is told of each entry dropped (metric)."""

    def __init__(self, max_entries: int, on_drop: Callable[[], None] | None = None) -> None:
        self.entries: deque[AuditEntry] = deque()
        self.max_entries = max_entries
        self._on_drop = on_drop

    def add(self, entry: AuditEntry) -> None:
        self.entries.append(entry)
        while len(self.entries) > self.max_entries:
            self.entries.popleft()
            if self._on_drop is not None:
                self._on_drop()

    def newest(self, limit: int) -> list[AuditEntry]:
        out: list[AuditEntry] = []
        for entry in reversed(self.entries):
            if len(out) >= limit:
                break
            out.append(entry)
        return out
