"""Per-replica load and per-tenant admissions shared between workers (shell: shared memory): the
table's layout, the supervisor's side and each worker's, with its replica slots and admitted count
(its tenant slots: :mod:`balancer.load.tenant_share`).

With ``kvlb serve --workers N``, each worker's :class:`~balancer.load.tracker.LoadTracker` is exact
for the requests that worker routed. So that every worker's policy sees the whole service's load on
each replica, and every worker's admission the whole service's requests (by tenant too), the
supervisor creates one fixed-size shared-memory table (:class:`LoadTable`, ``multiprocessing.shared_memory``)
with one row per worker; each worker writes only its own row (single writer, no lock) and reads the
others' rows.

A row is a header ``[seq, used, admitted, tenant_seq, tenant_used]``, ``limits.load_share_slots``
replica slots ``[key, prefill_seqs, prefill_tokens, decode_seqs, decode_blocks]`` and
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
counted (``on_overflow``, ``kvlb_load_share_overflow_replicas_total``). The tenant slots (the
worker's requests, prompt tokens and rate bucket time of each tenant, taken and freed by the same
rules) are :mod:`balancer.load.tenant_share`'s; the header and the slot allocator both sections use,
:mod:`balancer.load.share_row`'s.

``seq`` is a seqlock over the replica slots, ``tenant_seq`` one over the tenant slots (so that a
change of one section does not make the other workers read the other again): the writer makes it
odd, writes, makes it even again; a reader retries while it reads an odd value or a different one
after the data (at most :data:`~balancer.load.share_row.READ_ATTEMPTS` times, then it keeps that
section's last good read and counts a torn read). The header words and the tenant slots' words are
stored and loaded one by one through an int64 view of the segment (``memoryview.cast("q")``), one
8-byte ``memcpy`` each, which is one store on the platforms kvlb runs on (x86-64, arm64). Not
through ``struct.pack_into``: it zeroes the field and then writes it, so ``seq`` would pass through
0, an even value, on every store, and a reader that read 0 before and after the data would take a
half-written row as whole. A seqlock's reader sees whole rows on x86-64's ordered stores; elsewhere
a torn read can at worst mix one row's fields for one snapshot (the load is a routing hint; the next
snapshot reads again). A reader that finds every peer row's ``seq`` unchanged reuses its last sum,
so an idle service costs one header read per peer per snapshot. What a tenant's count on the other
workers costs: :mod:`balancer.load.tenant_share`.

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
import struct
import weakref
from collections.abc import Callable, Collection, Mapping
from multiprocessing import resource_tracker, shared_memory

from balancer.errors import ConfigError
from balancer.load.share_row import (
    ADMITTED_WORD,
    HEADER_BYTES,
    MAX_KEY_MEMO,
    READ_ATTEMPTS,
    USED_WORD,
    WORD_BYTES,
    Slots,
    segment_buffer,
    segment_words,
    zero_row,
)
from balancer.load.tenant_share import (
    ADMITTED_FIELD,
    PROMPT_TOKENS_FIELD,
    RATE_TAT_FIELD,
    TENANT_SLOT_BYTES,
    TenantShare,
)
from balancer.load.tracker import LoadCounts, combine
from balancer.types import ReplicaId

SLOT = struct.Struct("=qqqqq")
"""A slot: ``key`` (0: free), prefill requests, prefill tokens, decode sequences, decode blocks."""
SLOT_FIELDS = 5
LAYOUT = 0x6B76_6C62_0000_0002
"""The table's layout version ("kvlb" and 2: tenant slots of four words), its first layout word;
version 1 (tenant slots of two words) wrote no layout."""
LAYOUT_WORDS = 3
"""The words that end the table: :data:`LAYOUT`, replica slots a row, tenant slots a row."""

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
        with segment_words(self._shm) as words:
            at = workers * self._row_bytes // WORD_BYTES
            for offset, word in enumerate((LAYOUT, slots, tenant_slots)):
                words[at + offset] = word
        self.name = self._shm.name
        """What the workers attach by (``--load-table``)."""

    def zero_row(self, index: int) -> None:
        """Forget worker ``index``'s load (it exited: its requests are gone with it)."""
        if self._shm is not None and 0 <= index < self.workers:
            zero_row(self._shm, index * self._row_bytes, self._row_bytes)

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
        with segment_words(shm) as view:
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
        self._peers = [i for i in range(workers) if i != index]
        zero_row(shm, self._offset, size)
        self._words = segment_words(shm)
        # A share dropped without close() releases its view first, or the segment cannot close.
        weakref.finalize(self, self._words.release)
        self._seq: int = self._words[self._at]
        self._tenants = TenantShare(
            self._words,
            self._row_words,
            index,
            self._peers,
            (HEADER_BYTES + slots * SLOT.size) // WORD_BYTES,
            tenant_slots,
            on_overflow=on_tenant_overflow,
            on_torn=self._count_torn,
        )
        self._slots = Slots(slots, on_overflow)
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
        return self._tenants.overflow_total

    def publish(self, key: int, counts: LoadCounts) -> None:
        """Write this worker's load on the replica ``key`` (all zero: free its slot)."""
        shm = self._shm
        if shm is None:
            return
        idle = counts.prefill_seqs <= 0 and counts.decode_seqs <= 0
        found = self._slots.find(key, not idle)
        if found is None:
            return
        slot, fresh = found
        buf, words, row = segment_buffer(shm), self._words, self._at
        at = self._offset + HEADER_BYTES + slot * SLOT.size
        self._seq += 1
        words[row] = self._seq
        if idle:
            SLOT.pack_into(buf, at, 0, 0, 0, 0, 0)
            self._slots.release(key, slot)
        else:
            c = counts
            SLOT.pack_into(buf, at, key, c.prefill_seqs, c.prefill_tokens, c.decode_seqs, c.decode_blocks)
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
        if self._shm is not None:
            self._tenants.publish(key, ADMITTED_FIELD, admitted)

    def publish_tenant_tokens(self, key: int, prompt_tokens: int) -> None:
        """Write the prompt tokens this worker's requests of the tenant ``key`` hold of its
        ``limits.max_inflight_prompt_tokens_per_tenant`` (the ``on_tenant_tokens`` hook of its
        admission), as :meth:`publish_tenant` writes its requests: the tenant's slot is freed once
        both are 0."""
        if self._shm is not None:
            self._tenants.publish(key, PROMPT_TOKENS_FIELD, prompt_tokens)

    def publish_tenant_tat(self, key: int, tat_ns: int) -> None:
        """Write the time of the tenant ``key``'s bucket of ``limits.tenant_rate_per_s`` as this
        worker just set it (ns of the monotonic clock; the ``publish`` hook of
        :class:`balancer.service.tenant_rate.SharedRates`). The slot stays taken after the time has
        passed, until a sweep (:meth:`balancer.load.tenant_share.TenantShare.publish`) frees it."""
        if self._shm is not None:
            self._tenants.publish(key, RATE_TAT_FIELD, tat_ns)

    def peer_tenant_tat(self, key: int) -> int:
        """The latest time of the tenant ``key``'s rate bucket the other workers published (ns of
        the monotonic clock; 0: none)."""
        if self._shm is None:
            return 0
        return self._tenants.peer_latest(key, RATE_TAT_FIELD)

    def peer_tenant_admitted(self, key: int) -> int:
        """The requests of the tenant ``key`` the other workers have admitted now (the
        ``tenant_peers`` hook of the admission; negatives as 0). Per peer row: one header word read,
        a copy of its used tenant slots' bytes if they changed since the last read, and a look-up
        in that read (:mod:`balancer.load.tenant_share`)."""
        if self._shm is None:
            return 0
        return self._tenants.peer_sum(key, ADMITTED_FIELD)

    def peer_tenant_prompt_tokens(self, key: int) -> int:
        """The prompt tokens the other workers' requests of the tenant ``key`` hold now (the
        ``tenant_token_peers`` hook of the admission; negatives as 0), read as
        :meth:`peer_tenant_admitted` reads their requests."""
        if self._shm is None:
            return 0
        return self._tenants.peer_sum(key, PROMPT_TOKENS_FIELD)

    def _count_torn(self) -> None:
        """A peer row given up on for one snapshot (either section): counted."""
        self.torn_reads_total += 1
        if self._on_torn is not None:
            self._on_torn()

    def peer_totals(self) -> Mapping[int, LoadCounts]:
        """The other workers' load summed per replica key (cached while no peer row changed)."""
        shm = self._shm
        if shm is None or not self._peers:
            return {}
        words, size = self._words, self._row_words
        seqs = tuple(words[peer * size] for peer in self._peers)
        if seqs == self._sum_seqs:
            return self._sum
        buf = segment_buffer(shm)
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
        self._count_torn()
        cached = self._rows.get(peer)
        return {} if cached is None else cached[1]

    def close(self) -> None:
        """Empty this worker's row (its requests are over) and detach."""
        shm, self._shm = self._shm, None
        if shm is not None:
            self._words.release()
            zero_row(shm, self._offset, self._row_bytes)
            shm.close()
