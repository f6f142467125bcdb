"""The fleet's drained replicas as one balancer last read them from Redis (pure: no I/O, no clock).

:class:`DrainedMirror` holds ``<prefix>:drained``'s entries (replica id → its JSON text) as of the
change version it read (``<prefix>:drained:version{<prefix>:drained}``), so that a sync reads only
the entries changed since (:class:`~balancer.fleet.drain_sync.DrainSync`), and indexes the entries
that carry a removal time (a drain kept after its replica's removal): the prune and ``GET
/admin/replicas``' ``kept_drains`` read that index, not the whole hash. Times are Redis's
(``TIME``), passed in as ``now_s``: the removal stamp and the prune's comparison are on one clock,
whatever the balancers' wall clocks say (until 2026-12-01, h-fleetfollow2, each balancer compared
its own wall clock with the time another had written).

The entries' format (:func:`note_of`, :func:`removal_of`) is described in
:mod:`balancer.fleet.drain_sync`.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field

from balancer import strict_json
from balancer.health.book import DrainNote
from balancer.service.audit import DEFAULT_ACTOR

MARKER = ""
"""The hash's marker field (no replica id is empty): present once a balancer wrote the hash."""
REMOVED_AT = "removed_at_wall_ts"
"""The key of an entry's removal time (Unix s on Redis's clock since h-fleetfollow2; the marking
balancer's wall clock before), written by the balancer whose discovery removed it."""
KEPT_FROM = "kept_from_removal_wall_ts"
"""The key that replaces :data:`REMOVED_AT` when a balancer lists the replica again: the drain was
kept from before that removal (``health.drain_kept`` on every balancer and worker, whichever of them
cleared the removal time first)."""


def note_of(entry: str) -> DrainNote | None:
    """The note of a hash entry (``None`` for one seeded without a note, or damaged). An entry of a
    release before ``732957c`` (``{"by": <caller>, "at": <Unix s>}``, which a balancer of that release
    still writes in a mixed fleet during a rolling upgrade or a rollback) reads as the note this
    release writes for the same call: the caller it names, no actor given (``admin``), no reason.
    Until 2026-12-01 (h-upgrade) such a drain showed no note at all on the new balancers."""
    try:
        raw = strict_json.loads(entry)
    except (ValueError, RecursionError):
        return None
    return DrainNote.from_json(raw) or _previous_note(raw)


def _previous_note(raw: object) -> DrainNote | None:
    """The note of a previous release's entry ``{"by": <caller>, "at": <Unix s>}``, else ``None``."""
    if not isinstance(raw, dict) or set(raw) != {"by", "at"}:
        return None
    caller, at = raw["by"], raw["at"]
    if not isinstance(caller, str) or isinstance(at, bool) or not isinstance(at, int | float):
        return None
    return DrainNote(DEFAULT_ACTOR, caller, float(at), None)


def removal_of(entry: str, key: str = REMOVED_AT) -> tuple[dict[str, object], float] | None:
    """An entry with its removal time (``key``: :data:`REMOVED_AT`, or :data:`KEPT_FROM`): its JSON
    object and that time; ``None`` for any other."""
    if key not in entry:  # most entries: no parse
        return None
    try:
        raw = strict_json.loads(entry)
    except (ValueError, RecursionError):
        return None
    at = raw.get(key) if isinstance(raw, dict) else None
    if isinstance(at, bool) or not isinstance(at, int | float):
        return None
    return raw, float(at)


def prune_due(removed_at_s: float, now_s: float, keep_s: float) -> bool:
    """Whether a drain kept since ``removed_at_s`` is forgotten at ``now_s`` (both on Redis's clock):
    more than ``keep_s`` seconds (``health_drain_keep_s``) after the removal."""
    return now_s - removed_at_s > keep_s


@dataclass(frozen=True, slots=True)
class RemovedEntry:
    """An entry whose replica was removed by a balancer's discovery (it has :data:`REMOVED_AT`)."""

    replica: str
    entry: str
    """Its JSON text as read (a compare-and-set deletes it only if it is still this)."""
    removed_at_s: float
    """Its removal time, Unix seconds (Redis's clock; an older release's: its own wall clock)."""


@dataclass(slots=True)
class DrainedMirror:
    """``<prefix>:drained`` as last read: the entries, the version read, and the removed ones."""

    entries: dict[str, str] = field(default_factory=dict)
    """Replica id → its entry (JSON text), the marker :data:`MARKER` included."""
    removed: dict[str, RemovedEntry] = field(default_factory=dict)
    """The entries with a removal time, by replica id (in the order read or changed)."""
    epoch: str = ""
    """The change log's epoch as read (a new one after Redis lost its data); ``""``: not read yet."""
    version: int = 0
    """The change version the entries are as of: a sync reads the changes after it."""
    prune_from: int = 0
    """Where in :attr:`removed` the next prune window starts."""

    def replace(self, entries: Mapping[str, str], epoch: str, version: int) -> None:
        """The whole hash, read when the change log could not say what changed."""
        self.entries = dict(entries)
        self.removed = {}
        for replica, entry in self.entries.items():
            self._index(replica, entry)
        self.epoch, self.version = epoch, version

    def apply(self, changes: Mapping[str, str | None], epoch: str, version: int) -> None:
        """The entries changed since :attr:`version` (``None``: deleted), as of ``version``."""
        for replica, entry in changes.items():
            self.removed.pop(replica, None)
            if entry is None:
                self.entries.pop(replica, None)
            else:
                self.entries[replica] = entry
                self._index(replica, entry)
        self.epoch, self.version = epoch, version

    def _index(self, replica: str, entry: str) -> None:
        if replica == MARKER:
            return
        removal = removal_of(entry)
        if removal is not None:
            self.removed[replica] = RemovedEntry(replica, entry, removal[1])

    def prune_candidates(
        self, listed: Container[str], now_s: float, keep_s: float, *, scan: int, limit: int
    ) -> list[RemovedEntry]:
        """The removed entries of replicas not ``listed`` here whose keep time is over at ``now_s``
        (:func:`prune_due`): at most ``limit`` of the next ``scan`` removed entries (a window that
        moves on at each call)."""
        if not self.removed:
            return []
        removed = list(self.removed.values())
        start = self.prune_from % len(removed)
        window = (removed[start:] + removed[:start])[:scan]
        self.prune_from = start + len(window)
        due = [
            entry
            for entry in window
            if entry.replica not in listed and prune_due(entry.removed_at_s, now_s, keep_s)
        ]
        return due[:limit]

    def kept(self, listed: Container[str]) -> list[RemovedEntry]:
        """The drains kept for replicas no pool lists here (their entries have a removal time),
        newest removal first."""
        kept = [entry for entry in self.removed.values() if entry.replica not in listed]
        kept.sort(key=lambda entry: entry.removed_at_s, reverse=True)
        return kept
