"""Replica health: a circuit breaker per replica and the routable set (pure; callers pass ``now``).

A replica is routable when its breaker is closed (or half-open for one trial), its health probes say
it is live, its engine serves its pool's model (when the engine's list was read and it refuses other
names: :attr:`ReplicaHealth.model_mismatch`), the engine accepts kvlb's key where that is checked
(:attr:`ReplicaHealth.key_refused`), and it is not draining. A probe answered with anything
but 200, or refused, takes it out at once; probes that *timed out* take it out only after
``probe_timeouts_to_drop`` of them in a row: a timeout is ambiguous (a hung engine, or a stalled
host or balancer, which times out every replica's probe at once). A good probe puts it back. Request
failures before the first byte and failed probes, timeouts included, all count against the breaker;
``failure_threshold`` consecutive failures open it for ``open_s`` seconds, after which one trial
request is let through (half-open): success closes it, failure re-opens it.

With ``kvlb serve --workers N`` each worker discovers replicas on its own, so a drain replayed by a
sibling can name a replica this worker has not discovered yet: it is kept (:meth:`HealthBook.keep_drain`,
at most :data:`MAX_PENDING_DRAINS`, for :data:`PENDING_DRAIN_S`) and applied when the replica is added.

A drain belongs to the replica id: when discovery removes a drained replica, its drain is kept
(:meth:`HealthBook.remove`, "drained, removed at T") for ``drain_keep_s`` (``health_drain_keep_s``),
and the replica added again under that id within that time comes back drained
(:attr:`ReplicaHealth.kept_from_removal_wall_ts` says so). At most :data:`MAX_KEPT_DRAINS` such
records and :data:`MAX_KEPT_DRAIN_BYTES` bytes are kept, the oldest removal dropped first
(``kvlb_replica_kept_drains_dropped_total``); :meth:`HealthBook.forget_kept` (an undrain) ends one.
The note and the kept records are :mod:`balancer.health.drains`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from balancer.health.drains import (
    MAX_KEPT_DRAIN_BYTES,
    MAX_KEPT_DRAINS,
    DrainNote,
    KeptDrain,
    KeptDrainListing,
    kept_drain_bytes,
    kept_text,
)
from balancer.types import ReplicaId

__all__ = [
    "MAX_KEPT_DRAINS",
    "MAX_KEPT_DRAIN_BYTES",
    "MAX_PENDING_DRAINS",
    "PENDING_DRAIN_S",
    "PROBES_FAILING",
    "BreakerConfig",
    "BreakerState",
    "DrainNote",
    "HealthBook",
    "KeptDrain",
    "KeptDrainListing",
    "ReplicaHealth",
    "kept_drain_bytes",
    "kept_text",
]

BreakerState = Literal["closed", "open", "half_open"]

PENDING_DRAIN_S = 30.0
"""How long (seconds) a drain of a replica not discovered here yet waits for it (discovery polls
every 2 s by default; a Kubernetes watch is quicker)."""
MAX_PENDING_DRAINS = 64
"""Most drains kept for replicas not discovered yet; the oldest goes first
(``kvlb_replica_pending_drains_dropped_total``)."""


PROBES_FAILING = "failing health probes"
""":meth:`HealthBook.unroutable_reason` of a replica whose probes fail (its engine does not answer)."""


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 3
    """Consecutive failures that open the breaker (≥ 1)."""
    open_s: float = 5.0
    """Seconds an open breaker refuses traffic before one trial request is allowed."""
    probe_timeouts_to_drop: int = 2
    """Consecutive timed-out health probes after which a live replica stops taking traffic (≥ 1;
    ``health_timeouts_to_drop``)."""


@dataclass(slots=True)
class ReplicaHealth:
    """Mutable health record of one replica."""

    replica: ReplicaId
    probe_ok: bool = False
    draining: bool = False
    drain: DrainNote | None = None
    """Who drained it, when and why, while ``draining`` (``None`` when not known)."""
    kept_from_removal_wall_ts: float | None = None
    """While ``draining``: the Unix time of this id's removal by discovery whose drain it kept
    (``None``: drained while listed)."""
    consecutive_failures: int = 0
    probe_timeouts: int = 0
    """Health probes in a row that timed out (0 after any other result)."""
    opened_at: float | None = None
    trial_in_flight: bool = False
    last_probe_at: float | None = None
    last_error: str | None = None
    model_mismatch: str | None = None
    """Why the engine answers every request for the pool's model 404 (it lists other models), as
    the prober last read it; ``None``: it serves the pool's model, or that is not known. Such a
    replica is out of routing until the engine serves the pool's model."""
    key_refused: str | None = None
    """Why the engine refuses kvlb (401, 403, 407 on its ``GET /v1/models``, which vLLM guards with
    its ``--api-key`` while its ``/health`` and ``/metrics`` pass): ``engine refuses kvlb's key
    (<where the key is read>)``, as the prober last read it; ``None``: it accepts kvlb, or that is
    not known. Such a replica is out of routing until the engine accepts kvlb's key."""

    def state(self, now: float, config: BreakerConfig) -> BreakerState:
        if self.opened_at is None:
            return "closed"
        return "half_open" if now - self.opened_at >= config.open_s else "open"


@dataclass(slots=True)
class HealthBook:
    """Health of every replica; routing asks it which replicas are eligible."""

    config: BreakerConfig = field(default_factory=BreakerConfig)
    replicas: dict[ReplicaId, ReplicaHealth] = field(default_factory=dict)
    pending_drains: dict[ReplicaId, tuple[DrainNote | None, float]] = field(default_factory=dict)
    """Drains of replicas not known yet (:meth:`keep_drain`): the note, and when it came."""
    pending_drains_dropped: int = 0
    """Kept drains dropped for newer ones at :data:`MAX_PENDING_DRAINS`."""
    drain_keep_s: float = 0.0
    """How long (seconds) the drain of a replica discovery removed is kept for its id; 0: forgotten
    at the removal (``health_drain_keep_s``)."""
    kept_drains: dict[ReplicaId, KeptDrain] = field(default_factory=dict)
    """Drains of replicas discovery removed, oldest removal first (:meth:`remove`)."""
    kept_drains_bytes: int = 0
    """The sum of ``kept_drains``' ``size_bytes``."""
    kept_drains_dropped: int = 0
    """Kept drains dropped before their time at :data:`MAX_KEPT_DRAINS` or :data:`MAX_KEPT_DRAIN_BYTES`."""

    def add(self, replica: ReplicaId, probe_ok: bool = False, now: float | None = None) -> KeptDrain | None:
        """Know ``replica``; drained at once when its drain was kept at its removal within
        ``drain_keep_s`` of ``now`` (returned), or a sibling's drain of it was kept within
        :data:`PENDING_DRAIN_S` of ``now``."""
        rec = self.replicas.setdefault(replica, ReplicaHealth(replica, probe_ok=probe_ok))
        removed = self._take_kept(replica, now)
        if removed is not None:
            rec.draining, rec.drain = True, removed.note
            rec.kept_from_removal_wall_ts = removed.removed_at_wall_ts
        kept = self.pending_drains.pop(replica, None)
        if kept is not None and now is not None and now - kept[1] <= PENDING_DRAIN_S:
            rec.draining, rec.drain, rec.kept_from_removal_wall_ts = True, kept[0], None
        return removed

    def _take_kept(self, replica: ReplicaId, now: float | None) -> KeptDrain | None:
        if now is not None:
            self.expire_kept(now)
        kept = self.kept_drains.pop(replica, None)
        if kept is None:
            return None
        self.kept_drains_bytes -= kept.size_bytes
        return kept if now is not None else None

    def expire_kept(self, now: float) -> None:
        """Forget the kept drains removed more than ``drain_keep_s`` before ``now``."""
        while self.kept_drains:
            replica, kept = next(iter(self.kept_drains.items()))
            if now - kept.removed_at <= self.drain_keep_s:
                return
            del self.kept_drains[replica]
            self.kept_drains_bytes -= kept.size_bytes

    def kept_listing(
        self, now: float, wall: float, among: Iterable[tuple[ReplicaId, KeptDrain]] | None = None
    ) -> list[KeptDrainListing]:
        """The kept drains not expired at ``now`` (monotonic; ``wall``: the same moment in Unix s), of
        ``among`` (a copy of some of :attr:`kept_drains`' items, listed a few at a time) or all."""
        return [
            KeptDrainListing(
                replica,
                kept.note,
                kept.removed_at_wall_ts,
                wall + kept.removed_at + self.drain_keep_s - now,
                "memory",
            )
            for replica, kept in (self.kept_drains.items() if among is None else among)
            if now - kept.removed_at <= self.drain_keep_s
        ]

    def adopt_kept(
        self, replica: ReplicaId, note: DrainNote | None, removed_at_wall_ts: float, now: float, wall: float
    ) -> bool:
        """Keep a sibling worker's kept drain of ``replica`` (a restarted worker catching up), as if
        removed here at ``removed_at_wall_ts`` (``now`` monotonic, ``wall`` the same moment in Unix
        s); ``False`` when it is listed here, its time is over, or this book keeps a newer one."""
        removed_at = now - max(0.0, wall - removed_at_wall_ts)
        if self.drain_keep_s <= 0 or replica in self.replicas or now - removed_at > self.drain_keep_s:
            return False
        held = self.kept_drains.get(replica)
        if held is not None and held.removed_at_wall_ts >= removed_at_wall_ts:
            return False
        self.forget_kept(replica)
        kept = KeptDrain(note, removed_at_wall_ts, removed_at, kept_drain_bytes(replica, note))
        self._keep(replica, kept)
        return True

    def forget_kept(self, replica: ReplicaId) -> KeptDrain | None:
        """End the kept drain of ``replica`` (an undrain of a replica not listed); ``None`` if none."""
        kept = self.kept_drains.pop(replica, None)
        if kept is not None:
            self.kept_drains_bytes -= kept.size_bytes
        return kept

    def keep_drain(self, replica: ReplicaId, draining: bool, note: DrainNote | None, now: float) -> None:
        """A sibling's drain (or undrain) of ``replica``, not known here yet: a drain is applied if
        :meth:`add` comes within :data:`PENDING_DRAIN_S`; an undrain forgets a kept drain."""
        self.pending_drains.pop(replica, None)
        if not draining:
            self.forget_kept(replica)
        for name, (_, at) in list(self.pending_drains.items()):
            if now - at > PENDING_DRAIN_S:
                del self.pending_drains[name]
        if not draining:
            return
        if len(self.pending_drains) >= MAX_PENDING_DRAINS:
            del self.pending_drains[next(iter(self.pending_drains))]
            self.pending_drains_dropped += 1
        self.pending_drains[replica] = (note, now)

    def remove(
        self, replica: ReplicaId, now: float | None = None, wall: float | None = None
    ) -> KeptDrain | None:
        """Forget ``replica``. When discovery removed it (``now`` monotonic and ``wall`` Unix seconds
        given) while it was drained, its drain is kept for ``drain_keep_s`` (returned; ``None`` when
        not kept), the oldest kept drains dropped past the count and byte bounds."""
        rec = self.replicas.pop(replica, None)
        if rec is None or not rec.draining or now is None or wall is None:
            return None
        self.expire_kept(now)
        self.forget_kept(replica)
        if self.drain_keep_s <= 0:
            return None
        kept = KeptDrain(rec.drain, wall, now, kept_drain_bytes(replica, rec.drain))
        self._keep(replica, kept)
        return kept

    def _keep(self, replica: ReplicaId, kept: KeptDrain) -> None:
        """Add ``kept``, the oldest kept drains dropped past the count and byte bounds. The table
        stays in removal order (the oldest first: :meth:`expire_kept` stops at the first one not
        expired): an adopted drain older than the newest goes in its place."""
        while self.kept_drains and (
            len(self.kept_drains) >= MAX_KEPT_DRAINS
            or self.kept_drains_bytes + kept.size_bytes > MAX_KEPT_DRAIN_BYTES
        ):
            self.forget_kept(next(iter(self.kept_drains)))
            self.kept_drains_dropped += 1
        newest = next(reversed(self.kept_drains.values()), None)
        self.kept_drains[replica] = kept
        self.kept_drains_bytes += kept.size_bytes
        if newest is not None and kept.removed_at < newest.removed_at:
            self.kept_drains = dict(sorted(self.kept_drains.items(), key=lambda item: item[1].removed_at))

    def routable(self, now: float, among: Iterable[ReplicaId] | None = None) -> list[ReplicaId]:
        """Replicas that may take a new request now (order preserved)."""
        names = self.replicas.keys() if among is None else among
        out = []
        for name in names:
            rec = self.replicas.get(name)
            if rec is None or rec.draining or not rec.probe_ok or rec.model_mismatch is not None:
                continue
            if rec.key_refused is not None:
                continue
            state = rec.state(now, self.config)
            if state == "open" or (state == "half_open" and rec.trial_in_flight):
                continue
            out.append(name)
        return out

    def drained_only(self, now: float, among: Iterable[ReplicaId]) -> bool:
        """Whether some replica of ``among`` is out of routing only because it is drained (it would
        be routable undrained)."""
        for name in among:
            rec = self.replicas.get(name)
            if (
                rec is not None
                and rec.draining
                and rec.probe_ok
                and rec.model_mismatch is None
                and rec.key_refused is None
            ):
                state = rec.state(now, self.config)
                if state == "closed" or (state == "half_open" and not rec.trial_in_flight):
                    return True
        return False

    def unroutable_reason(self, replica: ReplicaId, now: float) -> str | None:
        """Why :meth:`routable` leaves ``replica`` out now (``None``: it does not): ``unknown``,
        ``draining``, ``failing health probes``, ``engine refuses kvlb's key (<source>)``, ``serves
        another model``, ``breaker open`` or ``breaker trial in flight``."""
        rec = self.replicas.get(replica)
        if rec is None:
            return "unknown"
        if rec.draining:
            return "draining"
        if not rec.probe_ok:
            return PROBES_FAILING
        if rec.key_refused is not None:
            return rec.key_refused
        if rec.model_mismatch is not None:
            return "serves another model"
        state = rec.state(now, self.config)
        if state == "open":
            return "breaker open"
        if state == "half_open" and rec.trial_in_flight:
            return "breaker trial in flight"
        return None

    def breaker_state(self, replica: ReplicaId, now: float) -> BreakerState | None:
        """The breaker of ``replica`` now (``None``: unknown replica)."""
        rec = self.replicas.get(replica)
        return None if rec is None else rec.state(now, self.config)

    def on_routed(self, replica: ReplicaId, now: float) -> None:
        """A request was sent; in half-open state it is the one trial."""
        rec = self.replicas.get(replica)
        if rec is not None and rec.state(now, self.config) == "half_open":
            rec.trial_in_flight = True

    def on_success(self, replica: ReplicaId) -> None:
        rec = self.replicas.get(replica)
        if rec is not None:
            rec.consecutive_failures = 0
            rec.opened_at = None
            rec.trial_in_flight = False
            rec.last_error = None

    def trial_now(self, replica: ReplicaId, now: float) -> bool:
        """Let the next request to ``replica`` be its breaker's trial at once, rather than after
        ``open_s``: what opened it is gone (its engine key was refused, and a new key was read).
        ``False`` (and nothing changed) unless its breaker is open."""
        rec = self.replicas.get(replica)
        if rec is None or rec.state(now, self.config) != "open":
            return False
        rec.opened_at = now - self.config.open_s
        return True

    def on_failure(self, replica: ReplicaId, now: float, error: str) -> None:
        rec = self.replicas.get(replica)
        if rec is None:
            return
        rec.consecutive_failures += 1
        rec.last_error = error
        rec.trial_in_flight = False
        if rec.opened_at is not None or rec.consecutive_failures >= self.config.failure_threshold:
            rec.opened_at = now

    def on_probe(
        self,
        replica: ReplicaId,
        ok: bool,
        now: float,
        error: str | None = None,
        *,
        timed_out: bool = False,
    ) -> None:
        """Result of a health probe: success marks it live (and resets the breaker after a failed
        probe); a failure counts against the breaker and takes the replica out, at once or, when
        it ``timed_out``, from the ``probe_timeouts_to_drop``-th timeout in a row."""
        rec = self.replicas.get(replica)
        if rec is None:
            return
        rec.last_probe_at = now
        was_ok, timeouts = rec.probe_ok, rec.probe_timeouts
        rec.probe_timeouts = timeouts + 1 if timed_out and not ok else 0
        if ok:
            rec.probe_ok = True
            if not was_ok or timeouts:
                self.on_success(replica)
            return
        if not timed_out or rec.probe_timeouts >= self.config.probe_timeouts_to_drop:
            rec.probe_ok = False
        self.on_failure(replica, now, error or "health probe failed")

    def set_model_mismatch(self, replica: ReplicaId, mismatch: str | None) -> bool:
        """Record what the replica's engine serves instead of its pool's model (``None``: it serves
        that model, or it is not known): the replica leaves routing while it is set. Returns whether
        that changed."""
        rec = self.replicas.get(replica)
        if rec is None or rec.model_mismatch == mismatch:
            return False
        rec.model_mismatch = mismatch
        return True

    def set_key_refused(self, replica: ReplicaId, refused: str | None) -> bool:
        """Record that the replica's engine refuses kvlb's key (``refused``: why, in the words of
        :meth:`unroutable_reason`; ``None``: it accepts it, or that is not known): the replica leaves
        routing while it is set. Returns whether that changed."""
        rec = self.replicas.get(replica)
        if rec is None or rec.key_refused == refused:
            return False
        rec.key_refused = refused
        return True

    def set_draining(self, replica: ReplicaId, draining: bool, note: DrainNote | None = None) -> bool:
        """Drain (with who, when and why: ``note``) or undrain ``replica``; ``False`` when unknown."""
        rec = self.replicas.get(replica)
        if rec is None:
            return False
        rec.draining = draining
        rec.drain = note if draining else None
        rec.kept_from_removal_wall_ts = None
        return True
