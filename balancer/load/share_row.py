"""One worker's row of the shared load table: its header, the word view it is read and written
through, how it is emptied, and the slot allocator of its sections (shell: shared memory).

A row (:mod:`balancer.load.share`) is this header, the replica slots
(:class:`balancer.load.share.LoadShare`) and the tenant slots
(:class:`balancer.load.tenant_share.TenantShare`); both sections take their slots through
:class:`Slots` and sit behind a seqlock word of this header. The header words are stored and loaded
one by one through an int64 view of the segment (:func:`segment_words`), one 8-byte ``memcpy`` each
(the module doc of :mod:`balancer.load.share` says why not ``struct.pack_into``).
"""

from __future__ import annotations

import heapq
import struct
from collections.abc import Callable
from multiprocessing import shared_memory

WORD_BYTES = 8
"""Bytes of one int64 word of the table."""
HEADER_WORDS = 5
"""A row's header: ``seq`` (the replica slots' seqlock, even when they are whole), ``used`` (replica
slots ever taken), ``admitted`` (the worker's admitted requests, written outside either seqlock),
``tenant_seq`` (the tenant slots' seqlock) and ``tenant_used`` (tenant slots ever taken). Each is
stored and loaded alone, as one word of the segment's int64 view (:func:`segment_words`): word 0 of the
row, then :data:`USED_WORD`, :data:`ADMITTED_WORD`, :data:`TENANT_SEQ_WORD`, :data:`TENANT_USED_WORD`."""
HEADER_BYTES = HEADER_WORDS * WORD_BYTES
USED_WORD = 1
ADMITTED_WORD = 2
TENANT_SEQ_WORD = 3
TENANT_USED_WORD = 4
WORD = struct.Struct("=q")
"""One int64 word in the host's byte order (as the segment's int64 view reads it)."""
READ_ATTEMPTS = 8
"""Reads of one row before a reader gives up on it for this snapshot (a writer mid-update)."""
MAX_KEY_MEMO = 65_536
"""Keys remembered by a reader/writer (or a section's overflowed keys) before its memo is cleared."""


def segment_buffer(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment's bytes (``ValueError`` once it is closed)."""
    buf = shm.buf
    if buf is None:  # typeshed: None once closed
        raise ValueError(f"shared memory {shm.name!r} is closed")
    return buf


def segment_words(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment as int64 words: an item store or load is one 8-byte ``memcpy`` (see
    :mod:`balancer.load.share`). Released before the segment is closed."""
    buf = segment_buffer(shm)
    return buf[: len(buf) - len(buf) % WORD_BYTES].cast("q")


def zero_row(shm: shared_memory.SharedMemory, offset: int, size: int) -> None:
    """Empty one row of ``size`` bytes under its two seqlocks (odd, zeros, even), whatever state its
    writer left it in. The seqlock words are only ever stored whole, never zeroed."""
    with segment_words(shm) as words:
        at = offset // WORD_BYTES
        seq, tenant_seq = words[at] | 1, words[at + TENANT_SEQ_WORD] | 1
        words[at] = seq
        words[at + TENANT_SEQ_WORD] = tenant_seq
        buf = segment_buffer(shm)
        buf[offset + WORD_BYTES : offset + TENANT_SEQ_WORD * WORD_BYTES] = bytes(
            (TENANT_SEQ_WORD - 1) * WORD_BYTES
        )
        start, end = offset + (TENANT_SEQ_WORD + 1) * WORD_BYTES, offset + size
        buf[start:end] = bytes(end - start)
        words[at + TENANT_SEQ_WORD] = tenant_seq + 1
        words[at] = seq + 1


class Slots:
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
