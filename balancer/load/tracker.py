"""Load accounting per replica (pure: no I/O, no clock reads; every call takes ``now``).

Two sources feed a :class:`LoadSnapshot`:

* **Router-tracked** (predictive, immediate): the router reserves a request on the replica it chose,
  moves it from prefill to decode on its first token and releases it at the end or on cancel.
  While in prefill a request counts its *uncached* prompt tokens; in decode, its KV blocks.
  These counts see this balancer's own traffic the moment it is routed.
* **Scraped** (lagging, fleet-wide): the engine's own ``running``/``waiting`` request counts and KV
  usage, given to :meth:`LoadTracker.observe` by the metrics scraper. They also see traffic sent by
  other balancers, but only as fresh as the last scrape: values older than ``stale_after_s`` are
  reported as ``None`` (never as a sentinel such as 0 or -1).

``now`` is monotonic seconds from the caller's clock. Every structure is bounded: tracked requests by
``max_tracked_requests`` (the oldest is dropped and counted), replicas with scraped stats by
``max_replicas``, and a reservation that sees no update for ``max_age_s`` is expired (a leaked
reservation, e.g. a lost ``release``, cannot pin load for ever). One tracker serves one pool, i.e. one
block size.

With ``kvlb serve --workers N`` each worker has its own tracker, exact for the requests it routed
itself. The other workers' committed load comes in as *peer* counts (:class:`LoadCounts` per
replica, read from shared memory by the shell, :mod:`balancer.load.share`) passed to
:meth:`LoadTracker.snapshot`, which adds them to its own; the tracker hands its own per-replica totals
out through the ``on_change`` hook after every change. Neither side does I/O here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from balancer.errors import ConfigError
from balancer.frozen import quick_init
from balancer.types import ReplicaId


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """Settings of a :class:`LoadTracker`."""

    block_size_tokens: int = 16
    """Tokens per KV block (the engines' page size / ``tokens_per_block``), used to turn pending
    prefill tokens into blocks. Must be ≥ 1; one tracker per block size."""
    stale_after_s: float = 5.0
    """Scraped engine stats older than this (seconds) are reported as ``None``. Must be > 0; a small
    value drops scraped data between two scrapes (set it to a few scrape intervals)."""
    max_age_s: float = 900.0
    """A reservation with no ``reserve``/``first_token`` update for this long (seconds) is expired
    and counted, so a lost ``release`` cannot pin load. Must be > 0; set it above the longest
    expected request (a too small value under-counts long generations)."""
    max_tracked_requests: int = 65_536
    """Cap on reservations held at once. At the cap the oldest reservation is dropped and counted as
    overflow. Must be ≥ 1."""
    max_replicas: int = 4_096
    """Cap on replicas with scraped stats. Stats of further replicas are ignored and counted.
    Must be ≥ 1."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first field out of range."""
        if self.block_size_tokens < 1:
            raise ConfigError(f"load.block_size_tokens must be >= 1, got {self.block_size_tokens}")
        for name in ("stale_after_s", "max_age_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"load.{name} must be a finite number > 0, got {value}")
        for name in ("max_tracked_requests", "max_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"load.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One scrape of an engine's own load gauges; a field is ``None`` when the engine did not
    report it.

    ``kv_usage`` is the used fraction of the KV pool, 0..1 (SGLang ``token_usage``, vLLM
    ``kv_cache_usage_perc``, TRT-LLM ``kvCacheStats`` used/max). ``capacity_tokens`` is the pool's
    size in tokens (SGLang ``max_total_num_tokens``, vLLM blocks × block size, TRT-LLM
    ``maxNumBlocks`` × tokens per block); it does not change while the engine runs, so the tracker
    keeps the last value reported and never lets it go stale.
    """

    running_reqs: int | None = None
    waiting_reqs: int | None = None
    kv_usage: float | None = None
    capacity_tokens: int | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """The load of one replica at snapshot time.

    Router-tracked fields are always present (0 when nothing is in flight). Scraped fields are
    ``None`` when never scraped, not reported, or older than ``stale_after_s``; ``stats_age_s`` is
    the age of the last scrape (present even when stale, ``None`` when never scraped).
    """

    replica: ReplicaId
    pending_prefill_seqs: int = 0
    """Sequences routed and not at their first token (a request counts its OpenAI ``n``)."""
    pending_prefill_tokens: int = 0
    pending_prefill_blocks: float = 0.0
    """``pending_prefill_tokens / block_size_tokens`` (fractional, as the cost is in blocks)."""
    active_decode_seqs: int = 0
    """Sequences decoding (a request counts its ``n``), as the engines' ``running_reqs`` do."""
    active_decode_blocks: int = 0
    waiting_reqs: int | None = None
    running_reqs: int | None = None
    kv_usage: float | None = None
    stats_age_s: float | None = None
    capacity_blocks: float | None = None
    """KV pool size in blocks of the snapshot's block size, from the last scrape that reported it
    (``None`` when never reported). Unlike the other scraped fields it is not dropped when stale."""
    peer_seqs: int = 0
    """Of :attr:`in_flight_seqs`, the sequences the other workers of this ``kvlb serve --workers N``
    committed (0 with one worker). The router-tracked fields above already include them."""

    @property
    def in_flight_seqs(self) -> int:
        """Sequences this balancer (all its workers) has on the replica (prefill + decode): each
        request counts its OpenAI ``n``, as the engines count it in ``running_reqs`` and
        ``waiting_reqs`` (an ``n = 8`` request is 8 in the engine's batch)."""
        return self.pending_prefill_seqs + self.active_decode_seqs

    @property
    def seq_load(self) -> int:
        """``in_flight_seqs + waiting_reqs`` (waiting counts 0 when unknown): the sequence-count
        load the baseline policies compare, in sequences on both sides. A request this balancer
        sent that is still queued in the engine counts twice, which deliberately penalises
        queueing."""
        return self.in_flight_seqs + (self.waiting_reqs or 0)


@quick_init
@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """Per-replica load at one instant. Replicas without any data are absent; use :meth:`of`."""

    now: float
    block_size_tokens: int
    replicas: dict[ReplicaId, ReplicaLoad] = field(default_factory=dict)

    def of(self, replica: ReplicaId) -> ReplicaLoad:
        """The load of ``replica``: an idle, unscraped one when nothing is known about it."""
        load = self.replicas.get(replica)
        return load if load is not None else ReplicaLoad(replica=replica)


class LoadCounts(NamedTuple):
    """One replica's router-committed load from one side: a tracker's own reservations
    (:meth:`LoadTracker.own`), or the sum of the other workers' (the ``peers`` of
    :meth:`LoadTracker.snapshot`). Counts are ≥ 0; blocks are the pool's reference blocks. A named
    tuple: built for every slot read from the shared table, so cheap to make."""

    prefill_seqs: int = 0
    """Sequences of the requests routed and not yet at their first token: a request counts its
    OpenAI ``n`` (the engine schedules that many), 1 without."""
    prefill_tokens: int = 0
    """Their uncached prompt tokens (the prefill still to do; the prompt once per request)."""
    decode_seqs: int = 0
    """Sequences of the requests past their first token and not yet released (each its ``n``)."""
    decode_blocks: int = 0
    """Their KV blocks (prompt + ``max_tokens``, in the pool's reference block size)."""

    @property
    def seqs(self) -> int:
        """Sequences in flight (prefill + decode): requests, each counted ``n`` times."""
        return self.prefill_seqs + self.decode_seqs


IDLE = LoadCounts()
"""No load: what :meth:`LoadTracker.own` returns for a replica with nothing in flight."""
UNSCRAPED = EngineStats()
"""No engine stats (immutable): what a snapshot reads for a replica never scraped, or stale."""


@dataclass(frozen=True, slots=True)
class LoadTrackerStats:
    """Counters of a :class:`LoadTracker` (exported as ``kvlb_load_*`` metrics)."""

    tracked_requests: int
    reserved_total: int
    released_total: int
    expired_total: int
    overflow_total: int
    """Reservations dropped because ``max_tracked_requests`` was reached."""
    duplicate_reserves_total: int
    unknown_ids_total: int
    """``first_token``/``release`` of an id not tracked (already released, expired or never seen)."""
    ignored_stats_total: int
    """Scrapes ignored because ``max_replicas`` replicas already had stats."""


@dataclass(slots=True)
class _Reservation:
    replica: ReplicaId
    prefill_tokens: int
    decode_blocks: int
    touched_at: float
    decoding: bool = False
    sequences: int = 1


@dataclass(slots=True)
class _Totals:
    prefill_seqs: int = 0
    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_blocks: int = 0

    def add(self, res: _Reservation, sign: int) -> None:
        if res.decoding:
            self.decode_seqs += sign * res.sequences
            self.decode_blocks += sign * res.decode_blocks
        else:
            self.prefill_seqs += sign * res.sequences
            self.prefill_tokens += sign * res.prefill_tokens

    def is_zero(self) -> bool:
        return self.prefill_seqs == 0 and self.decode_seqs == 0

    def counts(self) -> LoadCounts:
        return LoadCounts(self.prefill_seqs, self.prefill_tokens, self.decode_seqs, self.decode_blocks)


@dataclass(frozen=True, slots=True)
class _Scrape:
    stats: EngineStats
    at: float


class LoadTracker:
    """Router-side in-flight accounting plus the latest scraped engine stats, per replica.

    Every method is synchronous and cheap (O(1) amortised, ``snapshot`` O(replicas)), so it is
    called from the event loop without locks. All transitions are idempotent and safe on unknown
    ids: a second ``reserve`` of the same id is ignored, ``first_token``/``release`` of an unknown
    id only bump a counter.
    """

    def __init__(self, config: LoadConfig | None = None) -> None:
        self.config = config if config is not None else LoadConfig()
        self.config.validate()
        # Ordered by last update time, so expiry and overflow pop from the front.
        self._requests: OrderedDict[str, _Reservation] = OrderedDict()
        self._totals: dict[ReplicaId, _Totals] = {}
        self._scrapes: dict[ReplicaId, _Scrape] = {}
        self._capacity_tokens: dict[ReplicaId, int] = {}
        self._reserved = self._released = self._expired = self._overflow = 0
        self._duplicates = self._unknown = self._ignored_stats = 0
        self.on_change: Callable[[ReplicaId, LoadCounts], None] | None = None
        """Called with a replica's own new totals after each change of them (reserve, first token,
        release, expiry, overflow, forget). The shell sets it (``kvlb serve --workers N``: this
        worker's row of the shared load table); it must be cheap and must not call back in."""

    def reserve(
        self,
        request_id: str,
        replica: ReplicaId,
        prefill_tokens: int,
        decode_blocks: int,
        now: float,
        sequences: int = 1,
    ) -> bool:
        """Count a routed request on ``replica``: ``prefill_tokens`` uncached prompt tokens to
        prefill, then ``decode_blocks`` KV blocks held while decoding, as ``sequences`` (OpenAI's
        ``n``, at least 1) in the in-flight counts. Returns ``False`` (and changes nothing) when
        ``request_id`` is already tracked. Negative sizes count as 0."""
        self.expire(now)
        if request_id in self._requests:
            self._duplicates += 1
            return False
        while len(self._requests) >= self.config.max_tracked_requests:
            _, oldest = self._requests.popitem(last=False)
            self._drop(oldest)
            self._overflow += 1
        res = _Reservation(
            replica, max(0, prefill_tokens), max(0, decode_blocks), now, sequences=max(1, sequences)
        )
        self._requests[request_id] = res
        totals = self._totals.setdefault(replica, _Totals())
        totals.add(res, +1)
        self._reserved += 1
        if self.on_change is not None:
            self.on_change(replica, totals.counts())
        return True

    def first_token(self, request_id: str, now: float) -> bool:
        """Move a request from prefill to decode. Returns ``False`` for an unknown id; a second
        call only refreshes its age."""
        self.expire(now)
        res = self._requests.get(request_id)
        if res is None:
            self._unknown += 1
            return False
        if not res.decoding:
            totals = self._totals[res.replica]
            totals.add(res, -1)
            res.decoding = True
            totals.add(res, +1)
            if self.on_change is not None:
                self.on_change(res.replica, totals.counts())
        res.touched_at = now
        self._requests.move_to_end(request_id)
        return True

    def release(self, request_id: str, now: float) -> bool:
        """Forget a finished or cancelled request. Returns ``False`` for an unknown id (double
        release, already expired); nothing else happens then."""
        self.expire(now)
        res = self._requests.pop(request_id, None)
        if res is None:
            self._unknown += 1
            return False
        self._drop(res)
        self._released += 1
        return True

    def expire(self, now: float) -> int:
        """Expire reservations not updated for ``max_age_s``; returns how many went."""
        cutoff = now - self.config.max_age_s
        count = 0
        while self._requests:
            request_id, res = next(iter(self._requests.items()))
            if res.touched_at > cutoff:
                break
            del self._requests[request_id]
            self._drop(res)
            count += 1
        self._expired += count
        return count

    def in_flight(self, replica: ReplicaId) -> int:
        """Sequences held on ``replica`` now, in prefill or decode (as of the last expiry): each
        reservation counts its ``sequences``."""
        totals = self._totals.get(replica)
        return 0 if totals is None else totals.prefill_seqs + totals.decode_seqs

    def observe(self, replica: ReplicaId, stats: EngineStats, now: float) -> bool:
        """Record one scrape of ``replica``'s engine stats. Out-of-range values are sanitised:
        negative counts and non-finite usage become ``None``, usage is clamped to 0..1. Returns
        ``False`` when ignored because ``max_replicas`` replicas already have stats."""
        if replica not in self._scrapes and len(self._scrapes) >= self.config.max_replicas:
            self._ignored_stats += 1
            return False
        clean = _sanitise(stats)
        self._scrapes[replica] = _Scrape(clean, now)
        if clean.capacity_tokens is not None:
            self._capacity_tokens[replica] = clean.capacity_tokens
        return True

    def forget(self, replica: ReplicaId) -> int:
        """Drop a replica that left the pool: its scraped stats and reservations. Returns how many
        reservations went (they are neither released nor expired in the counters)."""
        self._scrapes.pop(replica, None)
        self._capacity_tokens.pop(replica, None)
        gone = [rid for rid, res in self._requests.items() if res.replica == replica]
        for rid in gone:
            del self._requests[rid]
        if self._totals.pop(replica, None) is not None and self.on_change is not None:
            self.on_change(replica, IDLE)
        return len(gone)

    def own(self, replica: ReplicaId) -> LoadCounts:
        """This tracker's own reservations on ``replica`` (as of the last expiry)."""
        totals = self._totals.get(replica)
        return IDLE if totals is None else totals.counts()

    def snapshot(
        self,
        now: float,
        peers: Mapping[ReplicaId, LoadCounts] | None = None,
        only: Collection[ReplicaId] | None = None,
    ) -> LoadSnapshot:
        """Per-replica load at ``now`` (expires stale reservations first). ``peers``: the load the
        other workers committed, per replica, added to this tracker's own (``peer_seqs`` says how
        much of the in-flight count is theirs); negative peer counts count as 0. ``only``: these
        replicas' alone (a listing made a few replicas at a time); ``None``: every replica's."""
        self.expire(now)
        block_size = self.config.block_size_tokens
        replicas: dict[ReplicaId, ReplicaLoad] = {}
        names = self._totals.keys() | self._scrapes.keys()
        if peers:
            names |= peers.keys()
        if only is not None:
            names &= set(only)
        for replica in names:
            mine = self._totals.get(replica)
            if mine is None:
                prefill_seqs = prefill_tokens = decode_seqs = decode_blocks = 0
            else:
                prefill_seqs, prefill_tokens = mine.prefill_seqs, mine.prefill_tokens
                decode_seqs, decode_blocks = mine.decode_seqs, mine.decode_blocks
            peer_seqs = 0
            peer = peers.get(replica) if peers else None
            if peer is not None:  # as combine(), without the intermediate objects
                peer_seqs = max(0, peer.prefill_seqs) + max(0, peer.decode_seqs)
                prefill_seqs += max(0, peer.prefill_seqs)
                prefill_tokens += max(0, peer.prefill_tokens)
                decode_seqs += max(0, peer.decode_seqs)
                decode_blocks += max(0, peer.decode_blocks)
            scrape = self._scrapes.get(replica)
            stats, age_s = UNSCRAPED, None
            if scrape is not None:
                age_s = max(0.0, now - scrape.at)
                if age_s <= self.config.stale_after_s:
                    stats = scrape.stats
            capacity = self._capacity_tokens.get(replica)
            replicas[replica] = ReplicaLoad(
                replica=replica,
                pending_prefill_seqs=prefill_seqs,
                pending_prefill_tokens=prefill_tokens,
                pending_prefill_blocks=prefill_tokens / block_size,
                active_decode_seqs=decode_seqs,
                active_decode_blocks=decode_blocks,
                peer_seqs=peer_seqs,
                waiting_reqs=stats.waiting_reqs,
                running_reqs=stats.running_reqs,
                kv_usage=stats.kv_usage,
                stats_age_s=age_s,
                capacity_blocks=None if capacity is None else capacity / block_size,
            )
        return LoadSnapshot(now=now, block_size_tokens=block_size, replicas=replicas)

    def stats(self) -> LoadTrackerStats:
        """Current counters."""
        return LoadTrackerStats(
            tracked_requests=len(self._requests),
            reserved_total=self._reserved,
            released_total=self._released,
            expired_total=self._expired,
            overflow_total=self._overflow,
            duplicate_reserves_total=self._duplicates,
            unknown_ids_total=self._unknown,
            ignored_stats_total=self._ignored_stats,
        )

    def _drop(self, res: _Reservation) -> None:
        totals = self._totals.get(res.replica)
        if totals is None:
            return
        totals.add(res, -1)
        if totals.is_zero():
            del self._totals[res.replica]
        if self.on_change is not None:
            self.on_change(res.replica, totals.counts())


def combine(own: LoadCounts, peers: LoadCounts) -> LoadCounts:
    """``own`` plus the other workers' ``peers`` (a negative peer count, from a corrupt or torn row,
    counts as 0)."""
    return LoadCounts(
        own.prefill_seqs + max(0, peers.prefill_seqs),
        own.prefill_tokens + max(0, peers.prefill_tokens),
        own.decode_seqs + max(0, peers.decode_seqs),
        own.decode_blocks + max(0, peers.decode_blocks),
    )


def _sanitise(stats: EngineStats) -> EngineStats:
    def count(value: int | None) -> int | None:
        return value if value is not None and value >= 0 else None

    usage = stats.kv_usage
    if usage is not None:
        usage = min(1.0, max(0.0, usage)) if math.isfinite(usage) else None
    capacity = stats.capacity_tokens
    return EngineStats(
        count(stats.running_reqs),
        count(stats.waiting_reqs),
        usage,
        capacity if capacity is not None and capacity > 0 else None,
    )
