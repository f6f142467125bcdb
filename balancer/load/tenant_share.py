"""The tenant slots of the shared load table: one worker's admissions by tenant, shared with the
other workers (shell: shared memory).

Each worker's row of the table (:mod:`balancer.load.share`; its header: :mod:`balancer.load.share_row`)
ends with ``limits.load_share_tenant_slots`` tenant slots ``[key, admitted, prompt_tokens, rate_tat_ns]``
(:data:`TENANT_SLOT_WORDS` int64 each), under the row's ``tenant_seq`` seqlock and counted by its
``tenant_used`` word. A tenant slot's ``key`` names a tenant (:func:`balancer.service.admission.tenant_key`
of its name; the default and the overflow tenants have fixed keys of their own) and ``admitted`` is
the worker's requests of that tenant in flight (``limits.max_inflight_per_tenant``,
:meth:`~balancer.load.share.LoadShare.publish_tenant`), ``prompt_tokens`` the prompt tokens its
requests hold here of the tenant's ``limits.max_inflight_prompt_tokens_per_tenant``
(:meth:`~balancer.load.share.LoadShare.publish_tenant_tokens`), ``rate_tat_ns`` the theoretical
arrival time of the tenant's bucket of ``limits.tenant_rate_per_s`` as this worker last set it
(:mod:`balancer.service.tenant_rate`: nanoseconds of the host's monotonic clock, which every process
shares; 0: none; :meth:`~balancer.load.share.LoadShare.publish_tenant_tat`), of which a worker takes
the latest of all rows (:meth:`~balancer.load.share.LoadShare.peer_tenant_tat`).

A tenant holds a slot while the worker has requests of it in flight, prompt tokens held or a bucket
time published, so an idle tenant costs nothing; the slots whose bucket time has passed (the bucket
is full again) and that hold nothing else are freed when a tenant finds no free slot (a sweep of
this worker's slots, at most once per :data:`SWEEP_S`); one that still finds no free tenant slot is
not shared and is counted (``on_tenant_overflow``, ``kvlb_load_share_overflow_tenants_total``).

The tenant slots' words are stored and loaded one by one through the segment's int64 view, one
8-byte ``memcpy`` each. A tenant's count on the other workers
(:meth:`~balancer.load.share.LoadShare.peer_tenant_admitted`) costs, per peer, one header read and a
byte search of the peer's used tenant slots as last read (bounded by
``limits.load_share_tenant_slots``; a dict look-up once that read was asked about :data:`DICT_AFTER`
times), plus a copy of their bytes when they changed since.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from balancer.load.share_row import (
    READ_ATTEMPTS,
    TENANT_SEQ_WORD,
    TENANT_USED_WORD,
    WORD,
    WORD_BYTES,
    Slots,
)

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
DICT_AFTER = 8
"""Look-ups of one read of a peer's tenant slots after which it is made into a dict."""


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


class TenantShare:
    """One worker's tenant slots (written) and the other workers' (read): the tenant section of its
    :class:`~balancer.load.share.LoadShare`, which owns the segment and calls this only while it is
    mapped. All on the worker's request loop."""

    def __init__(
        self,
        words: memoryview,
        row_words: int,
        index: int,
        peers: Sequence[int],
        tenant_at: int,
        capacity: int,
        *,
        on_overflow: Callable[[], None] | None,
        on_torn: Callable[[], None],
    ) -> None:
        """Over ``words`` (the segment's int64 view, rows of ``row_words`` words): this worker's row
        ``index``, the ``peers``' rows, the tenant slots starting ``tenant_at`` words into a row,
        ``capacity`` of them a row. ``on_torn`` is called for a peer read given up on."""
        self._words = words
        self._row_words = row_words
        self._at = index * row_words
        self._peers = peers
        self._tenant_at = tenant_at
        """Where a row's tenant slots start (in words from the row's start)."""
        self._capacity = capacity
        self._on_torn = on_torn
        self._seq: int = words[self._at + TENANT_SEQ_WORD]
        self.slots = Slots(capacity, on_overflow)
        """Which of this row's tenant slots each tenant holds."""
        self.reads: dict[int, _TenantRead] = {}
        """Each peer's last whole read of its tenant slots."""
        self._swept_at = float("-inf")

    @property
    def overflow_total(self) -> int:
        """Times a tenant found no free tenant slot (its requests here were then not shared)."""
        return self.slots.overflow_total

    def publish(self, key: int, field: int, value: int) -> None:
        """Write ``field`` of the tenant ``key``'s slot (taken if need be), under the tenant seqlock;
        the slot is freed when every field is 0 (or less). Written out word by word: it runs at each
        change of a tenant's count (docs/operations.md has the figures)."""
        words, row = self._words, self._at
        slots = self.slots
        slot = slots.slot_of.get(key)
        if slot is not None:
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            busy = value > 0 or (
                (field != ADMITTED_FIELD and words[at + ADMITTED_FIELD] > 0)
                or (field != PROMPT_TOKENS_FIELD and words[at + PROMPT_TOKENS_FIELD] > 0)
                or (field != RATE_TAT_FIELD and words[at + RATE_TAT_FIELD] > 0)
            )
            self._seq += 1
            words[row + TENANT_SEQ_WORD] = self._seq
            if busy:
                words[at + field] = value
            else:
                words[at] = 0
                words[at + ADMITTED_FIELD] = 0
                words[at + PROMPT_TOKENS_FIELD] = 0
                words[at + RATE_TAT_FIELD] = 0
                slots.release(key, slot)
            self._seq += 1
            words[row + TENANT_SEQ_WORD] = self._seq
            return
        if value > 0 and not slots.free and slots.used >= slots.capacity:
            self._sweep()
        found = slots.find(key, value > 0)
        if found is None:
            return
        slot = found[0]
        at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
        self._seq += 1
        words[row + TENANT_SEQ_WORD] = self._seq
        words[at + ADMITTED_FIELD] = 0
        words[at + PROMPT_TOKENS_FIELD] = 0
        words[at + RATE_TAT_FIELD] = 0
        words[at + field] = value
        words[at] = key
        words[row + TENANT_USED_WORD] = slots.used
        self._seq += 1
        words[row + TENANT_SEQ_WORD] = self._seq

    def _sweep(self) -> None:
        """Free this worker's tenant slots that hold nothing but a bucket time now past (at most once
        per :data:`SWEEP_S`; called when a tenant finds every slot taken)."""
        now = time.monotonic()
        if now < self._swept_at + SWEEP_S:
            return
        self._swept_at = now
        now_ns = int(now * 1e9)
        words, row = self._words, self._at
        idle: list[tuple[int, int]] = []
        for key, slot in self.slots.slot_of.items():
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            if (
                words[at + ADMITTED_FIELD] <= 0
                and words[at + PROMPT_TOKENS_FIELD] <= 0
                and words[at + RATE_TAT_FIELD] <= now_ns
            ):
                idle.append((key, slot))
        if not idle:
            return
        self._seq += 1
        words[row + TENANT_SEQ_WORD] = self._seq
        for key, slot in idle:
            at = row + self._tenant_at + slot * TENANT_SLOT_WORDS
            for f in range(TENANT_SLOT_WORDS):
                words[at + f] = 0
            self.slots.release(key, slot)
        self._seq += 1
        words[row + TENANT_SEQ_WORD] = self._seq

    def peer_sum(self, key: int, field: int) -> int:
        """``field`` of the tenant ``key`` summed over the other workers' rows (negatives as 0)."""
        total = 0
        for peer in self._peers:
            total += self._read(peer).count(key, field)
        return total

    def peer_latest(self, key: int, field: int) -> int:
        """The largest ``field`` of the tenant ``key`` in the other workers' rows (0: none)."""
        latest = 0
        for peer in self._peers:
            latest = max(latest, self._read(peer).count(key, field))
        return latest

    def _read(self, peer: int) -> _TenantRead:
        """The peer's used tenant slots, read whole under its tenant seqlock (kept while its
        ``tenant_seq`` stays the same); after :data:`~balancer.load.share_row.READ_ATTEMPTS` torn
        reads, its last whole read (counted)."""
        words, row = self._words, peer * self._row_words
        for _ in range(READ_ATTEMPTS):
            seq: int = words[row + TENANT_SEQ_WORD]
            if seq & 1:
                continue
            cached = self.reads.get(peer)
            if cached is not None and cached.seq == seq:
                return cached
            used = max(0, min(words[row + TENANT_USED_WORD], self._capacity))
            start = row + self._tenant_at
            raw = words[start : start + used * TENANT_SLOT_WORDS].tobytes()
            if words[row + TENANT_SEQ_WORD] != seq:
                continue
            read = self.reads[peer] = _TenantRead(seq, raw)
            return read
        self._on_torn()
        cached = self.reads.get(peer)
        return _TenantRead(-1, b"") if cached is None else cached
