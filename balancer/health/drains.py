"""A drain's note and the drains kept for replicas discovery removed (pure: no I/O, no clock).

:class:`DrainNote` is who drained a replica, when and why. A drain belongs to the replica id: when
discovery removes a drained replica, :class:`~balancer.health.book.HealthBook` keeps a
:class:`KeptDrain` ("drained, removed at T") for ``health_drain_keep_s``, bounded by
:data:`MAX_KEPT_DRAINS` and :data:`MAX_KEPT_DRAIN_BYTES` (:func:`kept_drain_bytes`);
:class:`KeptDrainListing` is one as ``GET /admin/replicas``' ``kept_drains`` lists it, and
:func:`kept_text` the words the log and the views use.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from balancer.types import ReplicaId

MAX_KEPT_DRAINS = 4096
"""Most drains kept for replicas discovery removed (:meth:`~balancer.health.book.HealthBook.remove`);
the oldest removal goes first (``kvlb_replica_kept_drains_dropped_total``)."""
MAX_KEPT_DRAIN_BYTES = 4 * 1024 * 1024
"""Most bytes (:func:`kept_drain_bytes`) of such kept drains; the oldest removal goes first."""
_KEPT_OVERHEAD_BYTES = 400
"""What one kept drain costs besides its strings (the record, the table's slot), measured roughly."""


@dataclass(frozen=True, slots=True)
class DrainNote:
    """Who drained a replica, when and why: shown by ``GET /admin/replicas`` and, in fleet mode,
    stored with the drain in Redis so that every balancer shows the same one."""

    by: str
    """The actor (``x-kvlb-actor``, ``admin`` when not given)."""
    caller: str
    """Who made the call: a token fingerprint and address (never the token)."""
    at_wall_ts: float
    """When, in Unix seconds."""
    reason: str | None = None
    """Why, as given (at most 500 characters), or ``None``."""

    def to_json(self) -> dict[str, Any]:
        return {"by": self.by, "caller": self.caller, "at_wall_ts": self.at_wall_ts, "reason": self.reason}

    def replayed(self) -> dict[str, Any]:
        """What a sibling worker is sent with the drain (the actor travels in ``x-kvlb-actor``)."""
        return {"reason": self.reason, "caller": self.caller, "at_wall_ts": self.at_wall_ts}

    @classmethod
    def from_json(cls, raw: object) -> DrainNote | None:
        """The note of :meth:`to_json`; ``None`` for anything else (an entry written before notes, or
        damaged)."""
        if not isinstance(raw, Mapping):
            return None
        by, caller, at, reason = (raw.get(k) for k in ("by", "caller", "at_wall_ts", "reason"))
        if not isinstance(by, str) or not isinstance(caller, str) or not isinstance(reason, str | None):
            return None
        if isinstance(at, bool) or not isinstance(at, int | float):
            return None
        return cls(by, caller, float(at), reason)


@dataclass(frozen=True, slots=True)
class KeptDrain:
    """The drain of a replica that discovery removed: "drained, removed at ``removed_at_wall_ts``"."""

    note: DrainNote | None
    """Who drained it, when and why (``None`` when not known)."""
    removed_at_wall_ts: float
    """When discovery removed it, in Unix seconds (shown)."""
    removed_at: float
    """The same on the caller's monotonic clock, seconds (the keep time counts from it)."""
    size_bytes: int
    """What it costs, estimated (:func:`kept_drain_bytes`)."""


@dataclass(frozen=True, slots=True)
class KeptDrainListing:
    """A drain kept for a replica no pool lists, as ``GET /admin/replicas``' ``kept_drains`` shows it."""

    replica: str
    note: DrainNote | None
    """Who drained it, when and why (``None`` when not known)."""
    removed_at_wall_ts: float
    """When discovery removed it, Unix seconds (in fleet mode on Redis's clock)."""
    expires_at_wall_ts: float
    """When it is forgotten (``health_drain_keep_s`` after the removal), on the same clock."""
    source: Literal["memory", "redis"]
    """Where it is kept: this process's health book, or the fleet's ``<prefix>:drained``."""
    clock_offset_s: float = 0.0
    """That clock minus this process's wall clock, seconds (0 for ``memory``)."""


def kept_drain_bytes(replica: ReplicaId, note: DrainNote | None) -> int:
    """The estimated bytes of one kept drain: its strings (UTF-8 as an upper bound of Python's
    compact strings plus a fixed overhead)."""
    strings = (replica,) if note is None else (replica, note.by, note.caller, note.reason or "")
    return _KEPT_OVERHEAD_BYTES + sum(len(text.encode("utf-8", "surrogatepass")) for text in strings)


def kept_text(note: DrainNote | None, removed_at_wall_ts: float) -> str:
    """``drained (kept from before its removal at <UTC time> by <actor>: <reason>)``."""
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(removed_at_wall_ts))
    if note is None:
        return f"drained (kept from before its removal at {when})"
    return f"drained (kept from before its removal at {when} by {note.by}: {note.reason or '-'})"
