"""Per-replica load and per-tenant admissions shared between workers (shell: shared memory).

With ``kvlb serve --workers N``, each worker's :class:`~balancer.load.tracker.LoadTracker` is exact
for the requests that worker routed. So that every worker's policy sees the whole service's load on
each replica, and every worker's admission the whole service's requests (by tenant too), the
supervisor creates one fixed-size shared-memory table (:class:`LoadTable`, ``multiprocessing.shared_memory``)
with one row per worker; each worker writes only its own row (single writer, no lock) and reads the
others' rows.

A row is a header ``[seq, used, admitted, tenant_seq, tenant_used]``, ``limits.load_share_slots``
replica slots ``[key, prefill_reqs, prefill_tokens, decode_seqs, decode_blocks]`` and
``limits.load_share_tenant_slots`` tenant slots ``[key, admitted, prompt_tokens, rate_tat_ns]``,
all int64 in the host's byte order (the table never leaves the host). After the rows, the table ends with its
layout (:data:`LAYOUT_WORDS`: :data:`LAYOUT`, the replica slots and the tenant slots a row has),
written by the supervisor and checked by each worker as it maps the table: a worker of another
layout (another kvlb release restarted under an older supervisor, or other settings) refuses to
map it (:class:`~balancer.errors.ConfigError`: the worker prints it and exits 2), with a message
saying which layout it found, instead of reading the rows wrongly.
``admitted`` is the worker's admitted requests
(``limits.max_inflight``, :meth:`LoadShare.publish_admitted`): one aligned 8-byte store, read
without a seqlock. A replica slot's ``key`` names a (pool, replica) (:func:`replica_key`, 0 = free
slot). A replica takes a slot in the worker's row while the worker has requests in flight on it and
frees it when it has none, so the slots bound the replicas *loaded at once* by one worker; a replica
that finds no free slot is not shared (the other workers see only their own load on it) and is
counted (``on_overflow``, ``kvlb_load_share_overflow_replicas_total``). A tenant slot's ``key`` names
a tenant (:func:`balancer.service.admission.tenant_key` of its name; the default and the overflow
tenants have fixed keys of their own) and ``admitted`` is the worker's requests of that tenant in
flight (``limits.max_inflight_per_tenant``, :meth:`LoadShare.publish_tenant`), ``prompt_tokens``
the prompt tokens its requests hold here of the tenant's
``limits.max_inflight_prompt_tokens_per_tenant`` (:meth:`LoadShare.publish_tenant_tokens`),
``rate_tat_ns`` the theoretical arrival time of the tenant's bucket of ``limits.tenant_rate_per_s``
as this worker last set it (:mod:`balancer.service.tenant_rate`: nanoseconds of the host's monotonic
clock, which every process shares; 0: none; :meth:`LoadShare.publish_tenant_tat`), of which a
worker takes the latest of all rows (:meth:`LoadShare.peer_tenant_tat`). The same rules hold: a
tenant holds a slot while the worker has requests of it in flight, prompt tokens held or a bucket
time published, so an idle tenant costs nothing; the slots whose bucket time has passed (the bucket
is full again) and that hold nothing else are freed when a tenant finds no free slot (a sweep of
this worker's slots, at most once per :data:`SWEEP_S`); one that still finds no free tenant slot is
not shared and is counted (``on_tenant_overflow``, ``kvlb_load_share_overflow_tenants_total``).

``seq`` is a seqlock over the replica slots, ``tenant_seq`` one over the tenant slots (so that a
change of one section does not make the other workers read the other again): the writer makes it
odd, writes, makes it even again; a reader retries while it reads an odd value or a different one
after the data (at most :data:`READ_ATTEMPTS` times, then it keeps that section's last good read and
counts a torn read). The header words and the tenant slots' words are stored and loaded one by
one through an int64 view of the segment (``memoryview.cast("q")``), one 8-byte ``memcpy`` each, which is
one store on the platforms kvlb runs on (x86-64, arm64). Not through ``struct.pack_into``: it zeroes
the field and then writes it, so ``seq`` would pass through 0, an even value, on every store, and a
reader that read 0 before and after the data would take a half-written row as whole. A seqlock's
reader sees whole rows on x86-64's ordered stores; elsewhere a torn read can at worst mix one row's
fields for one snapshot (the load is a routing hint; the next snapshot reads again). A reader that
finds every peer row's ``seq`` unchanged reuses its last sum, so an idle service costs one header
read per peer per snapshot. A tenant's count on the other workers
(:meth:`LoadShare.peer_tenant_admitted`) costs, per peer, one header read and a byte search of the
peer's used tenant slots as last read (bounded by ``limits.load_share_tenant_slots``; a dict
look-up once that read was asked about :data:`DICT_AFTER` times), plus a copy of their bytes when
they changed since.

**The caps read the table too.** ``limits.max_inflight_per_replica`` is checked against a replica's
in-flight requests summed over every row (:meth:`balancer.routing.router.PoolRouter.in_flight_total`),
``limits.max_inflight`` against the ``admitted`` of every row and ``limits.max_inflight_per_tenant``
against the tenant's ``admitted`` in every row, ``limits.max_inflight_prompt_tokens_per_tenant``
against the tenant's ``prompt_tokens`` in every row (:class:`balancer.service.admission.Admission`,
which knows only its hooks, not this table). There is no lock: a worker checks and then publishes,
synchronously on its one request loop (the router reads the chosen replica's count once more right
before it commits, :meth:`~balancer.routing.router.PoolRouter.route`, so the gap is microseconds, not
a whole plan), so at the moment a worker admits, each other worker has at most one admission it
checked but has not yet published. Two workers checking at once may both admit: the service can be
at most ``N - 1`` over any of these caps (``N`` workers), and only for as long as those requests
last. The bound does not hold for a replica or a tenant that found no free slot (its load from that
worker is not shared) nor for a read that gave up on a torn row (it uses that row's last whole
read); all are counted. The queue caps (``limits.max_queued``, ``limits.max_queued_per_tenant``)
and the tenant table (``limits.max_tenants``) stay per worker.

The supervisor zeroes a dead worker's row as soon as it exits (:meth:`LoadTable.zero_row`), so the
requests that died with it stop counting at once; the restarted worker starts from an empty row.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from multiprocessing import resource_tracker, shared_memory

from balancer.errors import ConfigError
from balancer.load.tracker import LoadCounts, combine
from balancer.types import ReplicaId

WORD_BYTES = 8
"""Bytes of one int64 word of the table."""
HEADER_WORDS = 5
"""A row's header: ``seq`` (the replica slots' seqlock, even when they are whole), ``used`` (replica
slots ever taken), ``admitted`` (the worker's admitted requests, written outside either seqlock),
``tenant_seq`` (the tenant slots' seqlock) and ``tenant_used`` (tenant slots ever taken). Each is
stored and loaded alone, as one word of the segment's int64 view (:func:`_words`): word 0 of the
row, then :data:`USED_WORD`, :data:`ADMITTED_WORD`, :data:`TENANT_SEQ_WORD`, :data:`TENANT_USED_WORD`."""
HEADER_BYTES = HEADER_WORDS * WORD_BYTES
USED_WORD = 1
ADMITTED_WORD = 2
TENANT_SEQ_WORD = 3
TENANT_USED_WORD = 4
SLOT = struct.Struct("=qqqqq")
"""A slot: ``key`` (0: free), prefill requests, prefill tokens, decode sequences, decode blocks."""
SLOT_FIELDS = 5
TENANT_SLOT_WORDS = 4
"""A tenant slot: ``key`` (0: free; :func:`balancer.service.admission.tenant_key`), the requests
of that tenant the worker has admitted (:data:`ADMITTED_FIELD`), the prompt tokens they hold
(:data:`PROMPT_TOKENS_FIELD`) and its rate bucket's time (:data:`RATE_TAT_FIELD`, ns)."""
ADMITTED_FIELD = 1
PROMPT_TOKENS_FIELD = 2
RATE_TAT_FIELD = 3
SWEEP_S = 1.0
"""Least seconds between two sweeps of this worker's tenant slots for expired bucket times."""
TENANT_SLOT_BYTES = TENANT_SLOT_WORDS * WORD_BYTES
WORD = struct.Struct("=q")
"""One int64 word in the host's byte order (as the segment's int64 view reads it)."""
DICT_AFTER = 8
"""Look-ups of one read of a peer's tenant slots after which it is made into a dict."""
READ_ATTEMPTS = 8
"""Reads of one row before a reader gives up on it for this snapshot (a writer mid-update)."""
LAYOUT = 0x6B76_6C62_0000_0002
"""The table's layout version ("kvlb" and 2: tenant slots of four words), its first layout word;
version 1 (tenant slots of two words) wrote no layout."""
LAYOUT_WORDS = 3
"""The words that end the table: :data:`LAYOUT`, replica slots a row, tenant slots a row."""
MAX_KEY_MEMO = 65_536
"""(pool, replica) keys remembered by a reader/writer before its memo is cleared."""


_ReadMemo = tuple[Mapping[int, LoadCounts], tuple[ReplicaId, ...], Mapping[ReplicaId, LoadCounts]]
"""A reader's last answer: the peer sums it read, the replicas asked, what it answered."""


def row_bytes(slots: int, tenant_slots: int = 0) -> int:
    """Bytes of one worker's row with ``slots`` replica slots and ``tenant_slots`` tenant slots."""
    return HEADER_BYTES + slots * SLOT.size + tenant_slots * TENANT_SLOT_BYTES


def table_bytes(workers: int, slots: int, tenant_slots: int = 0) -> int:
    """Bytes of the whole table: ``workers`` rows (:func:`row_bytes`) and the layout words."""
    return workers * row_bytes(slots, tenant_slots) + LAYOUT_WORDS * WORD_BYTES


def replica_key(model: str, replica: str) -> int:
    """A replica's name in the table: 63 bits of a BLAKE2b of its pool and id, never 0."""
    digest = hashlib.blake2b(f"{model}\0{replica}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF) or 1


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # typeshed: None once closed
        raise ValueError(f"shared memory {shm.name!r} is closed")
    return buf


def _words(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment as int64 words: an item store or load is one 8-byte ``memcpy`` (see the module
    doc). Released before the segment is closed."""
    buf = _buffer(shm)
    return buf[: len(buf) - len(buf) % WORD_BYTES].cast("q")


def _zero_row(shm: shared_memory.SharedMemory, offset: int, size: int) -> None:
    """Empty one row of ``size`` bytes under its two seqlocks (odd, zeros, even), whatever state its
    writer left it in. The seqlock words are only ever stored whole, never zeroed."""
    with _words(shm) as words:
        at = offset // WORD_BYTES
        seq, tenant_seq = words[at] | 1, words[at + TENANT_SEQ_WORD] | 1
        words[at] = seq
        words[at + TENANT_SEQ_WORD] = tenant_seq
        buf = _buffer(shm)
        buf[offset + WORD_BYTES : offset + TENANT_SEQ_WORD * WORD_BYTES] = bytes(
            (TENANT_SEQ_WORD - 1) * WORD_BYTES
        )
        start, end = offset + (TENANT_SEQ_WORD + 1) * WORD_BYTES, offset + size
        buf[start:end] = bytes(end - start)
        words[at + TENANT_SEQ_WORD] = tenant_seq + 1
        words[at] = seq + 1


def _find(raw: bytes, key: int, field: int = ADMITTED_FIELD) -> int:
    """``key``'s ``field`` (:data:`ADMITTED_FIELD`, :data:`PROMPT_TOKENS_FIELD`, :data:`RATE_TAT_FIELD`)
    in a row's tenant slots as read (their bytes: :data:`TENANT_SLOT_WORDS` int64 each), 0 if absent,
    negatives as 0: a byte search in C for the key's 8 bytes at a slot's start, no Python int made
    per slot."""
    needle = WORD.pack(key)
    at = raw.find(needle)
    while at >= 0:
        if at % TENANT_SLOT_BYTES == 0:
            return max(0, int(WORD.unpack_from(raw, at + field * WORD_BYTES)[0]))
        at = raw.find(needle, at + 1)  # the bytes straddle two words: not a key
    return 0


class _TenantRead:
    """One whole read of a peer row's tenant slots (their bytes) at ``seq``. A busy peer changes its
    row between two admissions here, so a fresh read is searched for the key asked (:func:`_find`)
    rather than made into a dict, which costs more than a few searches; a read asked about
    :data:`DICT_AFTER` times (an idle peer's row stays the same for many admissions) is made into
    one, and looked up in it from then on (docs/operations.md, "kvlb serve --workers N", has the
    figures)."""

    __slots__ = ("asked", "counts", "raw", "seq")

    def __init__(self, seq: int, raw: bytes) -> None:
        self.seq = seq
        self.raw = raw
        self.asked = 0
        self.counts: dict[int, tuple[int, ...]] | None = None

    def count(self, key: int, field: int = ADMITTED_FIELD) -> int:
        """``key``'s ``field`` in this read (0 if absent, negatives as 0)."""
        counts = self.counts
        if counts is None:
            self.asked += 1
            if self.asked < DICT_AFTER:
                return _find(self.raw, key, field)
            with memoryview(self.raw).cast("q") as view:
                values = view.tolist()
            step = TENANT_SLOT_WORDS
            counts = self.counts = {
                values[i]: tuple(values[i + 1 : i + step]) for i in range(0, len(values), step)
            }
        found = counts.get(key)
        return 0 if found is None else max(0, found[field - 1])


class _Slots:
    """Which slot of one section of this worker's row (replica or tenant slots) each key holds: a
    key takes a slot while it is busy and frees it when it is idle (the lowest free one is reused);
    a key that finds every slot taken is not shared and is counted once, until it is idle again."""

    __slots__ = ("capacity", "free", "on_overflow", "overflow_total", "slot_of", "unshared", "used")

    def __init__(self, capacity: int, on_overflow: Callable[[], None] | None) -> None:
        self.capacity = capacity
        self.on_overflow = on_overflow
        self.used = 0
        """Slots ever taken (the readers read this many)."""
        self.slot_of: dict[int, int] = {}
        self.free: list[int] = []
        self.unshared: set[int] = set()
        self.overflow_total = 0
        """Times a key found no free slot (its figures from here were then not shared)."""

    def find(self, key: int, busy: bool) -> tuple[int, bool] | None:
        """``key``'s slot and whether it was taken just now; ``None`` when there is nothing to write
        (an idle key without a slot, or no free slot)."""
        slot = self.slot_of.get(key)
        if slot is not None:
            return slot, False
        if not busy:
            self.unshared.discard(key)
            return None
        if self.free:
            slot = heapq.heappop(self.free)
        elif self.used < self.capacity:
            slot = self.used
            self.used += 1
        else:
            if key not in self.unshared:
                if len(self.unshared) >= MAX_KEY_MEMO:
                    self.unshared.clear()
                self.unshared.add(key)
                self.overflow_total += 1
                if self.on_overflow is not None:
                    self.on_overflow()
            return None
        self.slot_of[key] = slot
        self.unshared.discard(key)
        return slot, True

    def release(self, key: int, slot: int) -> None:
        """``key`` is idle: its slot is free again."""
        del self.slot_of[key]
        heapq.heappush(self.free, slot)


class LoadTable:
    """The supervisor's side: creates the shared table, zeroes dead workers' rows, removes it."""

    def __init__(self, workers: int, slots: int, tenant_slots: int = 0) -> None:
        self.workers = workers
        self.slots = slots
        self.tenant_slots = tenant_slots
        self._row_bytes = row_bytes(slots, tenant_slots)
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            create=True, size=table_bytes(workers, slots, tenant_slots)
        )
        with _words(self._shm) as words:
            at = workers * self._row_bytes // WORD_BYTES
            for offset, word in enumerate((LAYOUT, slots, tenant_slots)):
                words[at + offset] = word
        self.name = self._shm.name
        """What the workers attach by (``--load-table``)."""

    def zero_row(self, index: int) -> None:
        """Forget worker ``index``'s load (it exited: its requests are gone with it)."""
        if self._shm is not None and 0 <= index < self.workers:
            _zero_row(self._shm, index * self._row_bytes, self._row_bytes)

    def close(self) -> None:
        """Detach and remove the table (the workers are gone)."""
        shm, self._shm = self._shm, None
        if shm is not None:
            shm.close()
            shm.unlink()


class LoadShare:
    """One worker's side: publishes its own row, sums the other workers' rows (see the module doc).

    All are called on the worker's request loop: the publisher from the trackers' ``on_change``,
    the reader from :meth:`balancer.routing.router.PoolRouter.load_snapshot`, the tenant ones from
    the admission's hooks (:meth:`publish_tenant`, :meth:`peer_tenant_admitted`)."""

    def __init__(
        self,
        name: str,
        index: int,
        workers: int,
        slots: int,
        tenant_slots: int = 0,
        *,
        on_overflow: Callable[[], None] | None = None,
        on_tenant_overflow: Callable[[], None] | None = None,
        on_torn: Callable[[], None] | None = None,
        track: bool = False,
    ) -> None:
        """Attach to the supervisor's table ``name`` (``workers`` rows of ``slots`` replica slots and
        ``tenant_slots`` tenant slots) and empty this worker's row ``index``. ``track`` (as Python
        3.13's ``SharedMemory(track=)``): leave the segment registered with this process's resource
        tracker; only for a process that created the :class:`LoadTable` itself (tests)."""
        shm = shared_memory.SharedMemory(name=name)
        if not track:
            # Python < 3.13 registers an attached segment with this process's resource tracker,
            # which would unlink it when this worker exits; the supervisor owns it.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        size = row_bytes(slots, tenant_slots)
        if shm.size < table_bytes(workers, slots, tenant_slots):
            shm.close()
            raise ConfigError(
                f"load table {name!r} is {shm.size} bytes, smaller than {workers} rows of layout "
                f"{LAYOUT:#x} ({slots} replica slots, {tenant_slots} tenant slots): made by another "
                "kvlb release or other settings; restart the whole service"
            )
        with _words(shm) as view:
            at = workers * size // WORD_BYTES
            found = tuple(view[at : at + LAYOUT_WORDS].tolist())
        if found != (LAYOUT, slots, tenant_slots):
            shm.close()
            raise ConfigError(
                f"load table {name!r} has layout {found[0]:#x} with {found[1]} replica slots and "
                f"{found[2]} tenant slots; this worker maps layout {LAYOUT:#x} with {slots} and "
                f"{tenant_slots}: made by another kvlb release or other settings; restart the whole "
                "service"
            )
        self._shm: shared_memory.SharedMemory | None = shm
        self.index = index
        self.workers = workers
        self.slots = slots
        self.tenant_slots = tenant_slots
        self._on_torn = on_torn
        self._row_bytes = size
        self._offset = index * size
        self._row_words = size // WORD_BYTES
        self._at = index * self._row_words
        self._tenant_at = (HEADER_BYTES + slots * SLOT.size) // WORD_BYTES
        """Where a row's tenant slots start (in words from the row's start)."""
        self._peers = [i for i in range(workers) if i != index]
        _zero_row(shm, self._offset, size)
        self._words = _words(shm)
        # A share dropped without close() releases its view first, or the segment cannot close.
        weakref.finalize(self, self._words.release)
        self._seq: int = self._words[self._at]
        self._tenant_seq: int = self._words[self._at + TENANT_SEQ_WORD]
        self._tenant_slots = _Slots(tenant_slots, on_tenant_overflow)
        self._tenant_rows: dict[int, _TenantRead] = {}
        self._swept_at = float("-inf")
        self._slots = _Slots(slots, on_overflow)
        self._rows: dict[int, tuple[int, dict[int, LoadCounts]]] = {}
        self._sum: dict[int, LoadCounts] = {}
        self._sum_seqs: tuple[int, ...] = ()
        self._formats: dict[int, struct.Struct] = {}
        self.torn_reads_total = 0
        """Peer rows given up on for one snapshot after :data:`READ_ATTEMPTS` reads."""

    def publisher(self, model: str) -> Callable[[ReplicaId, LoadCounts], None]:
        """The ``on_change`` hook of ``model``'s tracker: writes that replica's slot in this row."""

        keys: dict[str, int] = {}

        def publish(replica: ReplicaId, counts: LoadCounts) -> None:
            key = keys.get(replica)
            if key is None:
                if len(keys) >= MAX_KEY_MEMO:
                    keys.clear()
                key = keys[replica] = replica_key(model, replica)
            self.publish(key, counts)

        return publish

    def reader(self, model: str) -> Callable[[Collection[ReplicaId]], Mapping[ReplicaId, LoadCounts]]:
        """The ``peer_load`` hook of ``model``'s router: the other workers' load on those replicas."""

        last: list[_ReadMemo] = []

        keys: dict[str, int] = {}

        def read(replicas: Collection[ReplicaId]) -> Mapping[ReplicaId, LoadCounts]:
            totals = self.peer_totals()
            if not totals:
                return {}
            names = tuple(replicas)
            if last and last[0][0] is totals and last[0][1] == names:
                return last[0][2]  # no peer row changed since: the same answer
            found: dict[ReplicaId, LoadCounts] = {}
            for replica in names:
                key = keys.get(replica)
                if key is None:
                    if len(keys) >= MAX_KEY_MEMO:
                        keys.clear()
                    key = keys[replica] = replica_key(model, replica)
                counts = totals.get(key)
                if counts is not None:
                    found[replica] = counts
            last[:] = [(totals, names, found)]
            return found

        return read

    @property
    def overflow_total(self) -> int:
        """Times a replica found no free slot (its load from here was then not shared)."""
        return self._slots.overflow_total

    @property
    def tenant_overflow_total(self) -> int:
        """Times a tenant found no free tenant slot (its requests here were then not shared)."""
        return self._tenant_slots.overflow_total

    def publish(self, key: int, counts: LoadCounts) -> None:
        """Write this worker's load on the replica ``key`` (all zero: free its slot)."""
        shm = self._shm
        if shm is None:
            return
        idle = counts.prefill_reqs <= 0 and counts.decode_seqs <= 0
        found = self._slots.find(key, not idle)
        if found is None:
            return
        slot, fresh = found
        buf, words, row = _buffer(shm), self._words, self._at
        at = self._offset + HEADER_BYTES + slot * SLOT.size
        self._seq += 1
        words[row] = self._seq
        if idle:
            SLOT.pack_into(buf, at, 0, 0, 0, 0, 0)
            self._slots.release(key, slot)
        else:
            c = counts
            SLOT.pack_into(buf, at, key, c.prefill_reqs, c.prefill_tokens, c.decode_seqs, c.decode_blocks)
        if fresh:
            words[row + USED_WORD] = self._slots.used
        self._seq += 1
        words[row] = self._seq

    def publish_admitted(self, admitted: int) -> None:
        """Write this worker's admitted requests (the ``on_change`` hook of its admission): one
        aligned 8-byte store, outside the seqlock (the slots' readers do not read it)."""
        if self._shm is not None:
            self._words[self._at + ADMITTED_WORD] = admitted

    def peer_admitted(self) -> int:
        """The requests the other workers have admitted now (their ``admitted``, negatives as 0)."""
        if self._shm is None:
            return 0
        words, size = self._words, self._row_words
        return sum(max(0, words[peer * size + ADMITTED_WORD]) for peer in self._peers)

    def publish_tenant(self, key: int, admitted: int) -> None:
        """Write this worker's admitted requests of the tenant ``key`` (the ``on_tenant_change`` hook
        of its admission; 0: free the tenant's slot). Under the row's tenant seqlock, one aligned
        8-byte store per word; a tenant that finds every tenant slot taken is not shared (counted
        once until it has nothing in flight here again)."""
        if self._shm is None:
            return
        self._publish_tenant_field(key, ADMITTED_FIELD, admitted)

    def publish_tenant_tokens(self, key: int, prompt_tokens: int) -> None:
        """Write the prompt tokens this worker's requests of the tenant ``key`` hold of its
        ``limits.max_inflight_prompt_tokens_per_tenant`` (the ``on_tenant_tokens`` hook of its
        admission), as :meth:`publish_tenant` writes its requests: the tenant's slot is freed once
        both are 0."""
        if self._shm is None:
            return
        self._publish_tenant_field(key, PROMPT_TOKENS_FIELD, prompt_tokens)

    def _publish_tenant_field(self, key: int, field: int, value: int) -> None:
        """Write ``field`` of the tenant ``key``'s slot (taken if need be), under the tenant seqlock;
        the slot is freed when every field is 0 (or less). Written out word by word: it runs at each
        change of a tenant's count (docs/operations.md has the figures)."""
        words, row = self._words, self._at
        slots = self._tenant_slots
        slot = slots.slot_of.get(key)
        if slot is not None:
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            busy = value > 0 or (
                (field != ADMITTED_FIELD and words[at + ADMITTED_FIELD] > 0)
                or (field != PROMPT_TOKENS_FIELD and words[at + PROMPT_TOKENS_FIELD] > 0)
                or (field != RATE_TAT_FIELD and words[at + RATE_TAT_FIELD] > 0)
            )
            self._tenant_seq += 1
            words[row + TENANT_SEQ_WORD] = self._tenant_seq
            if busy:
                words[at + field] = value
            else:
                words[at] = 0
                words[at + ADMITTED_FIELD] = 0
                words[at + PROMPT_TOKENS_FIELD] = 0
                words[at + RATE_TAT_FIELD] = 0
                slots.release(key, slot)
            self._tenant_seq += 1
            words[row + TENANT_SEQ_WORD] = self._tenant_seq
            return
        if value > 0 and not slots.free and slots.used >= slots.capacity:
            self._sweep_tenants()
        found = slots.find(key, value > 0)
        if found is None:
            return
        slot = found[0]
        at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
        self._tenant_seq += 1
        words[row + TENANT_SEQ_WORD] = self._tenant_seq
        words[at + ADMITTED_FIELD] = 0
        words[at + PROMPT_TOKENS_FIELD] = 0
        words[at + RATE_TAT_FIELD] = 0
        words[at + field] = value
        words[at] = key
        words[row + TENANT_USED_WORD] = slots.used
        self._tenant_seq += 1
        words[row + TENANT_SEQ_WORD] = self._tenant_seq

    def publish_tenant_tat(self, key: int, tat_ns: int) -> None:
        """Write the time of the tenant ``key``'s bucket of ``limits.tenant_rate_per_s`` as this
        worker just set it (ns of the monotonic clock; the ``publish`` hook of
        :class:`balancer.service.tenant_rate.SharedRates`). The slot stays taken after the time has
        passed, until a sweep (:meth:`_sweep_tenants`) frees it."""
        if self._shm is None:
            return
        self._publish_tenant_field(key, RATE_TAT_FIELD, tat_ns)

    def peer_tenant_tat(self, key: int) -> int:
        """The latest time of the tenant ``key``'s rate bucket the other workers published (ns of
        the monotonic clock; 0: none)."""
        if self._shm is None:
            return 0
        latest = 0
        for peer in self._peers:
            latest = max(latest, self._tenant_read(peer).count(key, RATE_TAT_FIELD))
        return latest

    def _sweep_tenants(self) -> None:
        """Free this worker's tenant slots that hold nothing but a bucket time now past (at most once
        per :data:`SWEEP_S`; called when a tenant finds every slot taken)."""
        now = time.monotonic()
        if now < self._swept_at + SWEEP_S:
            return
        self._swept_at = now
        now_ns = int(now * 1e9)
        words, row = self._words, self._at
        idle: list[tuple[int, int]] = []
        for key, slot in self._tenant_slots.slot_of.items():
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            if (
                words[at + ADMITTED_FIELD] <= 0
                and words[at + PROMPT_TOKENS_FIELD] <= 0
                and words[at + RATE_TAT_FIELD] <= now_ns
            ):
                idle.append((key, slot))
        if not idle:
            return
        self._tenant_seq += 1
        words[row + TENANT_SEQ_WORD] = self._tenant_seq
        for key, slot in idle:
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            for f in range(TENANT_SLOT_WORDS):
                words[at + f] = 0
            self._tenant_slots.release(key, slot)
        self._tenant_seq += 1
        words[row + TENANT_SEQ_WORD] = self._tenant_seq

    def peer_tenant_admitted(self, key: int) -> int:
        """The requests of the tenant ``key`` the other workers have admitted now (the
        ``tenant_peers`` hook of the admission; negatives as 0). Per peer row: one header word read,
        a copy of its used tenant slots' bytes if they changed since the last read, and a look-up
        in that read (:class:`_TenantRead`)."""
        if self._shm is None:
            return 0
        total = 0
        for peer in self._peers:
            total += self._tenant_read(peer).count(key)
        return total

    def peer_tenant_prompt_tokens(self, key: int) -> int:
        """The prompt tokens the other workers' requests of the tenant ``key`` hold now (the
        ``tenant_token_peers`` hook of the admission; negatives as 0), read as
        :meth:`peer_tenant_admitted` reads their requests."""
        if self._shm is None:
            return 0
        total = 0
        for peer in self._peers:
            total += self._tenant_read(peer).count(key, PROMPT_TOKENS_FIELD)
        return total

    def _tenant_read(self, peer: int) -> _TenantRead:
        """The peer's used tenant slots, read whole under its tenant seqlock (kept while its
        ``tenant_seq`` stays the same); after :data:`READ_ATTEMPTS` torn reads, its last whole read
        (counted)."""
        words, row = self._words, peer * self._row_words
        for _ in range(READ_ATTEMPTS):
            seq: int = words[row + TENANT_SEQ_WORD]
            if seq & 1:
                continue
            cached = self._tenant_rows.get(peer)
            if cached is not None and cached.seq == seq:
                return cached
            used = max(0, min(words[row + TENANT_USED_WORD], self.tenant_slots))
            start = row + self._tenant_at
            raw = words[start : start + used * TENANT_SLOT_WORDS].tobytes()
            if words[row + TENANT_SEQ_WORD] != seq:
                continue
            read = self._tenant_rows[peer] = _TenantRead(seq, raw)
            return read
        self.torn_reads_total += 1
        if self._on_torn is not None:
            self._on_torn()
        cached = self._tenant_rows.get(peer)
        return _TenantRead(-1, b"") if cached is None else cached

    def peer_totals(self) -> Mapping[int, LoadCounts]:
        """The other workers' load summed per replica key (cached while no peer row changed)."""
        shm = self._shm
        if shm is None or not self._peers:
            return {}
        words, size = self._words, self._row_words
        seqs = tuple(words[peer * size] for peer in self._peers)
        if seqs == self._sum_seqs:
            return self._sum
        buf = _buffer(shm)
        rows = [self._read_row(buf, peer) for peer in self._peers]
        if len(rows) == 1:
            self._sum = rows[0]  # two workers: the other row is the sum
        else:
            total: dict[int, LoadCounts] = {}
            for row in rows:
                for key, c in row.items():
                    acc = total.get(key)
                    total[key] = c if acc is None else combine(acc, c)
            self._sum = total
        self._sum_seqs = tuple(self._rows[peer][0] if peer in self._rows else -1 for peer in self._peers)
        return self._sum

    def _read_row(self, buf: memoryview, peer: int) -> dict[int, LoadCounts]:
        words, at = self._words, peer * self._row_words
        offset = at * WORD_BYTES
        for _ in range(READ_ATTEMPTS):
            seq: int = words[at]
            if seq & 1:
                continue
            cached = self._rows.get(peer)
            if cached is not None and cached[0] == seq:
                return cached[1]
            used = max(0, min(words[at + USED_WORD], self.slots))
            fmt = self._formats.get(used)
            if fmt is None:
                fmt = self._formats[used] = struct.Struct(f"={used * SLOT_FIELDS}q")
            values = fmt.unpack_from(buf, offset + HEADER_BYTES)
            if words[at] != seq:
                continue
            row = {
                values[i]: LoadCounts(values[i + 1], values[i + 2], values[i + 3], values[i + 4])
                for i in range(0, len(values), SLOT_FIELDS)
                if values[i] != 0
            }
            self._rows[peer] = (seq, row)
            return row
        self.torn_reads_total += 1
        if self._on_torn is not None:
            self._on_torn()
        cached = self._rows.get(peer)
        return {} if cached is None else cached[1]

    def close(self) -> None:
        """Empty this worker's row (its requests are over) and detach."""
        shm, self._shm = self._shm, None
        if shm is not None:
            self._words.release()
            _zero_row(shm, self._offset, self._row_bytes)
            shm.close()
