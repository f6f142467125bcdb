"""``Mirror``: a local copy of one key space's Redis index, fed by its applied-event stream (I/O).

The mirror is the fleet's read side, not a ``PrefixIndex``: nothing applies events to it but the
stream. The request path reads the mirror's :class:`~balancer.index.table.PrefixTable`, never
Redis. The mirror replays the stream's batches (see :mod:`balancer.index.redis.stream`) in stream
order. Its table has the same semantics and budget as the Redis index, so it reaches the same
holders, evictions included (the index contract suite runs on it). Each balancer's own
speculative entries stay local; they count toward the local budget, so under eviction pressure a
mirror may evict slightly differently from Redis.

The mirror's tables are :class:`~balancer.index.locked.LockedPrefixTable` s: in fleet mode the mirror
runs on the ingest thread (:mod:`balancer.fleet.space_mirror`) while the request loop reads the table
and adds its speculative entries to it, as the embedded mode's ingestion does. Nothing in this class
depends on which loop runs it; ``between_entries`` (if given) is called after each applied entry (the
fleet passes :func:`~balancer.sources.ingest_thread.yield_gil`).

**Warm start** builds a fresh table off to the side, then installs it (``on_table``), so routing
keeps reading the previous table meanwhile. It loads the latest table snapshot if there is one
(:mod:`balancer.index.snapshot`, written by some balancer with :meth:`Mirror.write_snapshot`)
and replays only the entries after it; with no usable snapshot it replays every retained entry
(``XRANGE``). It then tails with ``XREAD BLOCK``.

Entries are numbered consecutively (field ``n``). A mirror that finds entries missing (trimmed by
``MAXLEN ~`` or the byte bound before it read them, or a Redis that lost its data) warm-starts again
and counts a resync; so does one that reads another stream epoch (field ``g``): a stream restarted within the
millisecond of the last entry read reuses IDs ``XREAD`` then skips, and its numbering may land right
after the last number read. A stream trimmed before any snapshot covered it yields a *partial*
mirror: blocks stored before the oldest retained entry stay unknown until an engine stores them
again. A partial mirror compares itself with the Redis index every
``MirrorSettings.partial_check_s``: once its table holds, for every replica, at least as many blocks
as Redis's ``held`` counts say, at the same stream entry, it has learned back or seen removed what it
lacked and is partial no more (by counts, not key by key). ``ready`` is set after the first warm
start. Redis errors are counted and retried with exponential backoff; the table keeps serving
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter

from balancer.errors import EventDecodeError
from balancer.index.base import HeldKeys, IndexStats
from balancer.index.hashing import BlockHasher
from balancer.index.locked import LockedPrefixTable
from balancer.index.memory import MemoryIndex
from balancer.index.redis.client import REDIS_ERRORS, RedisClient
from balancer.index.redis.schema import RedisIndexSettings, RedisKeys
from balancer.index.redis.stream import StreamEntry, decode_entry, entry_number
from balancer.index.slots import TableLimits
from balancer.index.snapshot import SnapshotError, capture, encode, load_table
from balancer.index.table import PrefixTable
from balancer.log_limit import LimitedWarnings
from balancer.types import BlockKey, Overlap, ReplicaId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MirrorSettings:
    """How a mirror reads the stream."""

    read_count: int = 512
    """Entries per ``XRANGE``/``XREAD`` call; bounds the memory of one read."""
    block_ms: int = 1000
    """``XREAD BLOCK`` timeout in milliseconds; bounds how long a stop request waits."""
    retry_s: float = 0.1
    """First pause after a Redis error (seconds); doubles per consecutive error up to
    ``retry_max_s``. Errors are counted, never raised."""
    retry_max_s: float = 0.5
    """Longest pause between two attempts while Redis is unreachable (seconds): also how late, at
    most, the mirror notices that Redis is back (one reconnect attempt per pause is cheap)."""
    partial_check_s: float = 5.0
    """Seconds between two checks of a partial mirror against the Redis index's block counts (one
    ``HGETALL`` of ``held``, a field per cache, and one ``HGET``); > 0."""

    def __post_init__(self) -> None:
        if self.read_count <= 0 or self.block_ms <= 0 or self.retry_s < 0 or self.retry_max_s < self.retry_s:
            raise ValueError(f"invalid mirror settings: {self}")
        if not 0 < self.partial_check_s < float("inf"):
            raise ValueError(f"invalid mirror settings: partial_check_s must be > 0: {self}")


@dataclass(slots=True)
class MirrorCounters:
    entries_applied: int = 0
    resyncs: int = 0
    """Rebuilds after entries went missing between two reads."""
    decode_errors: int = 0
    """Entries skipped because they could not be decoded (the mirror then diverges: resync)."""
    redis_errors: int = 0
    snapshots_loaded: int = 0
    snapshots_refused: int = 0
    """Snapshots present but unusable (other key space, corrupt, or older than the stream)."""
    partial_cleared: int = 0
    """Times a partial mirror found it held every replica's blocks again (by Redis's counts)."""


class Mirror:
    """Tails one key space's stream into a local table. ``client`` must use ``decode_responses=False``."""

    def __init__(
        self,
        client: RedisClient,
        hasher: BlockHasher,
        settings: RedisIndexSettings,
        clock: Callable[[], float],
        mirror: MirrorSettings | None = None,
        *,
        limits: TableLimits | None = None,
        on_table: Callable[[PrefixTable], None] | None = None,
        suppressed: Counter | None = None,
        forgotten: Counter | None = None,
        between_entries: Callable[[], None] | None = None,
    ) -> None:
        """``clock`` gives ``now`` for the local table (the routing clock: speculative entries are
                local). ``on_table`` is called with each newly built table once it is complete, on the loop
                that runs the mirror. Repeated Redis errors and undecodable entries are logged once, then once
                a minute with the count, which ``suppressed`` (``kvlb_log_suppressed_total``) counts too
        (``forgotten``: ``kvlb_log_causes_forgotten_total``, the limiter's causes dropped at its cap).
                ``between_entries`` is called after each entry applied while tailing or replaying."""
        self.client = client
        self.hasher = hasher
        self.settings = settings
        self.mirror = mirror or MirrorSettings()
        self.counters = MirrorCounters()
        self._warnings = LimitedWarnings(log, suppressed, clock=time.monotonic, forgotten=forgotten)
        self.limits = limits or TableLimits(capacity_blocks=settings.capacity_blocks)
        self.table = self._new_table()
        """The local copy; replaced by a fresh one on a warm start (read it through this attribute)."""
        self.index = MemoryIndex.over(self.table)
        """``table`` behind the async ``PrefixIndex`` facade (replaced with it)."""
        self.last_id = "0-0"
        self.last_number = 0
        self.bytes_read = 0
        """Bytes of the stream entries read so far (their fields' names and values, as
        ``stream_max_bytes`` counts them): the snapshot keeper's measure of how far the stream moved."""
        self.epoch: bytes | None = None
        """The stream epoch of the last entry applied (``None``: none seen, or an older writer's)."""
        self.partial = False
        """True when the history before the oldest retained entry was trimmed before we read it."""
        self.lag_s: float | None = None
        """Our wall clock minus the Redis time in the ID of the last entry applied while tailing."""
        self.ready = asyncio.Event()
        self.connected = False
        """Whether the last Redis call succeeded."""
        self.thread: str | None = None
        """Name of the thread the last entry was applied on (``None`` before the first)."""
        self._keys = RedisKeys(settings)
        self._stream = self._keys.stream
        self._clock = clock
        self.on_table = on_table
        """Told each newly built table (set it before the mirror starts)."""
        self._between_entries = between_entries
        self._replay_last = ("0-0", 0)
        self._replay_partial = False
        self._replay_epoch: bytes | None = None
        self._counts_at: tuple[int, dict[str, int]] | None = None
        """Redis's blocks per replica as of stream entry ``[0]``, read while the mirror was behind
        it: compared once the mirror has applied that entry (:meth:`check_partial`)."""
        self._next_check = 0.0

    def _new_table(self) -> LockedPrefixTable:
        return LockedPrefixTable(self.hasher, self.limits)

    # ------------------------------------------------------------------ reading

    async def warm_start(self) -> int:
        """Build a table from the snapshot (if usable) and the entries after it, then install it.

        Returns how many stream entries were applied."""
        epoch = await self.client.hget(self._keys.counters, "stream_epoch")  # for a snapshot alone
        self._replay_epoch = epoch if isinstance(epoch, bytes) else None
        fresh, number, last_id, partial = await self._from_snapshot()
        applied, continuous = await self._replay(fresh, last_id, number)
        if not continuous:  # the snapshot is older than the retained stream: start from scratch
            self.counters.snapshots_refused += 1
            fresh, number, last_id, partial = self._new_table(), 0, "0-0", False
            applied, _ = await self._replay(fresh, last_id, number)
            partial = True
        else:
            partial = partial or self._replay_partial
        self.table, self.index, self.partial = fresh, MemoryIndex.over(fresh), partial
        self.last_id, self.last_number = self._replay_last
        self.epoch = self._replay_epoch
        self._counts_at = None
        if self.on_table is not None:
            self.on_table(fresh)
        self.ready.set()
        return applied

    async def _from_snapshot(self) -> tuple[LockedPrefixTable, int, str, bool]:
        data = await self.client.get(self._keys.snapshot)
        if isinstance(data, bytes) and data:
            try:
                snap = await asyncio.to_thread(
                    load_table, data, self.hasher, self.limits, table_type=LockedPrefixTable
                )
            except SnapshotError as exc:
                self.counters.snapshots_refused += 1
                log.warning("mirror of %s: ignoring snapshot: %s", self._stream, exc)
            else:
                self.counters.snapshots_loaded += 1
                assert isinstance(snap.table, LockedPrefixTable)  # table_type
                return snap.table, snap.entry_number, snap.entry_id, snap.partial
        return self._new_table(), 0, "0-0", False

    async def _replay(self, into: PrefixTable, after_id: str, after_number: int) -> tuple[int, bool]:
        """Apply every retained entry after ``after_id``; ``False`` if entries right after it are gone."""
        self._replay_last = (after_id, after_number)
        self._replay_partial = False
        applied = 0
        start = "-" if after_id == "0-0" else "(" + after_id
        cursor = after_id  # the last entry read, decodable or not: the next read starts after it
        while True:
            raw = await self.client.xrange(self._stream, min=start, count=self.mirror.read_count)
            if not raw:
                self._replay_last = (cursor, self._replay_last[1])
                return applied, True
            for entry_id, fields in raw:
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                entry = self._decode(entry_id, fields)
                if entry is None:  # skipped; a numbered one held a batch we now lack
                    number = entry_number(fields)
                    if number is not None and number > self._replay_last[1]:
                        self._replay_last = (cursor, number)
                        self._replay_partial = True
                    continue
                expected = self._replay_last[1] + 1
                if entry.number != expected:
                    if after_number and applied == 0:
                        return 0, False
                    self._replay_partial = self._replay_partial or entry.number > 1
                await self._apply(entry, into)
                self._replay_last = (entry.entry_id, entry.number)
                self._replay_epoch = entry.epoch or self._replay_epoch
                applied += 1
                if self._between_entries is not None:
                    self._between_entries()
            start = "(" + cursor

    async def poll(self, block_ms: int | None = None) -> int:
        """Apply the entries added since the last read, waiting up to ``block_ms`` for the first."""
        wait = self.mirror.block_ms if block_ms is None else block_ms
        reply = await self.client.xread(
            {self._stream: self.last_id}, count=self.mirror.read_count, block=wait
        )
        if not reply:
            return 0
        _, raw = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", reply)[0]
        applied = 0
        for entry_id, fields in raw:
            entry = self._decode(entry_id, fields)
            if entry is None:  # skip past it (never read it again); it may have held a batch
                self.last_id = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                if entry_number(fields) is None:
                    continue  # no entry number: not written by APPLY, nothing lost
                self.counters.resyncs += 1
                log.warning("mirror of %s: entry %s unreadable, rebuilding", self._stream, self.last_id)
                return applied + await self.warm_start()
            epoch, known = entry.epoch, self.epoch
            # another epoch, numbered on (numbers that went back are said below): a restarted stream
            if epoch is not None and known is not None and epoch != known and entry.number > self.last_number:
                self.counters.resyncs += 1
                log.warning(
                    "mirror of %s: entry %d is of another stream epoch (%s after %s): Redis lost the "
                    "stream (a FLUSHALL, a restart without persistence); rebuilding",
                    self._stream, entry.number, epoch.decode(errors="replace"),
                    known.decode(errors="replace"),
                )  # fmt: skip
                return applied + await self.warm_start()
            if entry.number != self.last_number + 1:
                self.counters.resyncs += 1
                if entry.number <= self.last_number:  # until 2026-12-01 logged as "entries 56..0 missing"
                    log.warning(
                        "mirror of %s: entry numbers went back (%d after %d): Redis lost the stream (a "
                        "FLUSHALL, a restart without persistence, an eviction); rebuilding",
                        self._stream, entry.number, self.last_number,
                    )  # fmt: skip
                else:
                    missing = (self.last_number + 1, entry.number - 1)
                    log.warning("mirror of %s: entries %d..%d missing, rebuilding", self._stream, *missing)
                return applied + await self.warm_start()
            await self._apply(entry, self.table)
            self.last_id, self.last_number = entry.entry_id, entry.number
            self.epoch = entry.epoch or self.epoch
            self.lag_s = time.time() - int(entry.entry_id.partition("-")[0]) / 1000
            if self._counts_at is not None and self._counts_at[0] <= entry.number:
                self._compare_counts(*self._counts_at)
            applied += 1
            if self._between_entries is not None:
                self._between_entries()
        return applied

    async def run(self, stop: asyncio.Event) -> None:
        """Warm start, then tail until ``stop`` is set; Redis errors are counted and retried."""
        delay_s = self.mirror.retry_s
        while not stop.is_set():
            try:
                if not self.ready.is_set():
                    await self.warm_start()
                await self.poll()
                if self.partial and time.monotonic() >= self._next_check:
                    self._next_check = time.monotonic() + self.mirror.partial_check_s
                    await self.check_partial()
                self.connected = True
                self._warnings.resolved("mirror_redis_error", self._stream)
                delay_s = self.mirror.retry_s
            except REDIS_ERRORS as exc:
                self.connected = False
                self.counters.redis_errors += 1
                self._warnings.warning(
                    "mirror_redis_error", self._stream, "mirror of %s: redis error: %s", self._stream, exc
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay_s)
                delay_s = min(self.mirror.retry_max_s, max(delay_s * 2, 0.01))

    async def check_partial(self) -> bool:
        """Read the Redis index's blocks per replica (``held``) and the number of its last stream entry
        in one transaction, and clear :attr:`partial` if the table holds at least as many for every
        replica at that entry: now, or once :meth:`poll` has applied it. Returns :attr:`partial`."""
        if not self.partial:
            return False
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self._keys.held)
        pipe.hget(self._keys.counters, "stream_entries")
        held, number = await pipe.execute()
        counts: dict[str, int] = {}
        for cache_id, count in cast("dict[bytes, bytes]", held).items():
            replica = cache_id.decode(errors="replace").rpartition("#")[0]
            with contextlib.suppress(ValueError):
                counts[replica] = counts.get(replica, 0) + int(count)
        entry = int(number) if number is not None and bytes(number).isdigit() else 0
        if entry <= self.last_number:  # (below: Redis lost entries; the next poll rebuilds)
            self._compare_counts(entry, counts)
        else:
            self._counts_at = (entry, counts)
        return self.partial

    def _compare_counts(self, entry: int, counts: dict[str, int]) -> None:
        self._counts_at = None
        if entry != self.last_number or not self.partial:
            return
        table = self.table
        if all(table.held_blocks(ReplicaId(replica)) >= count for replica, count in counts.items()):
            self.partial = False
            self.counters.partial_cleared += 1
            log.info(
                "mirror of %s: holds as many blocks per replica as Redis at entry %d: no longer partial",
                self._stream, entry,
            )  # fmt: skip

    def _decode(self, entry_id: Any, fields: Any) -> StreamEntry | None:
        if isinstance(fields, dict):
            self.bytes_read += sum(len(name) + len(value) for name, value in fields.items())
        try:
            return decode_entry(entry_id, fields)
        except EventDecodeError as exc:
            self.counters.decode_errors += 1
            self._warnings.warning(
                "mirror_bad_entry",
                self._stream,
                "mirror of %s: skipping entry %r: %s",
                self._stream,
                entry_id,
                exc,
            )
            return None

    async def _apply(self, entry: StreamEntry, into: PrefixTable) -> None:
        if entry.dropped:
            into.drop_replica(entry.replica)
        elif entry.dropped_keys:
            into.drop_blocks(entry.replica, entry.dropped_keys)
        else:
            into.apply(entry.replica, entry.events, self._clock())
        self.counters.entries_applied += 1
        self.thread = threading.current_thread().name

    # ------------------------------------------------------------------ snapshots

    def snapshot(self) -> bytes:
        """The current table (speculative entries left out) as of the last applied entry."""
        table = self.table
        with table.lock:  # the request loop may be adding speculative entries meanwhile
            state = capture(table)
        return encode(state, self.last_number, self.last_id, self.partial)

    async def write_snapshot(self) -> int:
        """Store :meth:`snapshot` in Redis for starting mirrors; returns its size in bytes. Call it
        on the loop that runs the mirror (the copy is then of one entry's state).

        Only the copy of the table's state runs on that loop, under the table's lock (readers wait
        for it); encoding runs in a worker thread."""
        table = self.table
        with table.lock:
            state = capture(table)
        data = await asyncio.to_thread(encode, state, self.last_number, self.last_id, self.partial)
        await self.client.set(self._keys.snapshot, data)
        return len(data)

    # ------------------------------------------------------------------ the local index
    # The read half of the ``PrefixIndex`` seam. Routing reads the installed table instead; these
    # serve the contract suite (writes through a RedisIndex, reads here), the tests and the benches.

    async def match(
        self, keys: Sequence[BlockKey], among: Collection[ReplicaId] | None, now: float
    ) -> Overlap:
        return await self.index.match(keys, among, now)

    async def add_speculative(
        self, replica: ReplicaId, keys: Sequence[BlockKey], ttl_s: float, now: float
    ) -> None:
        await self.index.add_speculative(replica, keys, ttl_s, now)

    async def stats(self) -> IndexStats:
        return await self.index.stats()

    async def held_keys(self, replica: ReplicaId, limit: int) -> list[HeldKeys]:
        return await self.index.held_keys(replica, limit)
