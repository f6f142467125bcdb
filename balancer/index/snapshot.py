"""Whole-table snapshots of a :class:`~balancer.index.table.PrefixTable` (pure: bytes in, bytes out).

A balancer's mirror writes one to Redis now and then, with the number and ID of the last stream
entry it reflects; a starting balancer loads it and tails the stream from that ID, instead of
replaying history the stream no longer holds (``docs/redis-fleet.md``).

What is kept: every cache's engine-hash map (stale entries included: they still chain children),
its duplicate-handle counts, every block key with its holder caches in LRU order, and which of
those keys are prompt roots (``PrefixTable.held_roots``). Speculative holdings are local to each
balancer and are left out (a key only they held is dropped).

Layout: ``MAGIC``, a little-endian u32 header length, a msgpack header, then raw little-endian
arrays: the block keys (u64) in LRU order, one u32 per key indexing the header's distinct holder
sets, then per cache its engine hashes (u64) and their keys (u64), then the root keys (u64; the
header's ``roots`` counts them, absent in snapshots from before roots were kept: none). Arrays
keep both directions at C speed: a million blocks take well under a second each way.

This module reads the table's private fields on purpose: it is the table's serialisation, kept
apart only to keep :mod:`balancer.index.table` short. :func:`capture` copies what it needs (C-level
dict copies, tens of milliseconds per million blocks) so that :func:`encode`, the slow part, can
run in a worker thread while the event loop goes on changing the table.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from balancer.index.hashing import BlockHasher
from balancer.index.slots import CacheSlot, TableLimits
from balancer.index.table import PrefixTable
from balancer.types import ReplicaId

MAGIC = b"KVLBSNP1"
_U32 = struct.Struct("<I")


class SnapshotError(ValueError):
    """The bytes are not a snapshot of a table with this hasher."""


@dataclass(frozen=True, slots=True)
class TableSnapshot:
    """A decoded snapshot: the rebuilt table and the stream position it reflects."""

    table: PrefixTable
    entry_number: int
    entry_id: str
    partial: bool
    """The table it was taken from was itself partial (history trimmed before it was built)."""


@dataclass(frozen=True, slots=True)
class _Cache:
    replica: str
    dp_rank: int
    bit: int
    held: int
    keys: dict[int, int]
    dups: dict[int, int]


@dataclass(frozen=True, slots=True)
class TableCapture:
    """A copy of a table's state, safe to encode in another thread."""

    hasher: BlockHasher
    holders: dict[int, int]
    caches: tuple[_Cache, ...]
    spec_mask: int
    roots: list[int]


def capture(table: PrefixTable) -> TableCapture:
    """Copy the parts of ``table`` a snapshot needs (call on the thread that changes the table)."""
    caches = tuple(
        _Cache(c.replica, c.dp_rank, c.bit, c.held, c.keys.copy(), c.dups.copy())
        for ranks in table._slots.caches.values()
        for c in ranks.values()
    )
    return TableCapture(
        table.hasher, table._holders.copy(), caches, table._slots.spec_mask, list(table._roots.listed)
    )


def dump_table(table: PrefixTable, entry_number: int, entry_id: str, partial: bool = False) -> bytes:
    """Serialise ``table`` (without speculative holdings) as of stream entry ``entry_number``."""
    return encode(capture(table), entry_number, entry_id, partial)


def encode(state: TableCapture, entry_number: int, entry_id: str, partial: bool = False) -> bytes:
    """The snapshot bytes of a :func:`capture` (pure; any thread)."""
    caches = state.caches
    position = {cache.bit: i for i, cache in enumerate(caches)}
    real = 0
    for cache in caches:
        real |= cache.bit
    holders = state.holders
    if state.spec_mask:
        pairs = [(k, m & real) for k, m in holders.items() if m & real]
        keys = array("Q", [k for k, _ in pairs])
        masks = [m for _, m in pairs]
    else:
        keys = array("Q", holders.keys())
        masks = list(holders.values())
    roots = array("Q", [k for k in state.roots if holders.get(k, 0) & real])
    distinct: dict[int, int] = {}
    index = array("I", [distinct.setdefault(m, len(distinct)) for m in masks])
    sets = [_bits_to_positions(mask, position) for mask in distinct]
    header = {
        "bs": state.hasher.block_size,
        "mode": state.hasher.mode,
        "model": state.hasher.model,
        "n": entry_number,
        "id": entry_id,
        "partial": partial,
        "keys": len(keys),
        "sets": sets,
        "caches": [[c.replica, c.dp_rank, c.held, len(c.keys), list(c.dups.items())] for c in caches],
        "roots": len(roots),
    }
    packed = cast(bytes, msgpack.packb(header, use_bin_type=True))
    parts = [MAGIC, _U32.pack(len(packed)), packed, _le(keys), _le(index)]
    for cache in caches:
        parts.append(_le(array("Q", cache.keys.keys())))
        parts.append(_le(array("Q", cache.keys.values())))
    parts.append(_le(roots))
    return b"".join(parts)


def load_table(
    data: bytes,
    hasher: BlockHasher,
    limits: TableLimits | None = None,
    *,
    table_type: type[PrefixTable] = PrefixTable,
) -> TableSnapshot:
    """Rebuild a table from :func:`dump_table` bytes; raises :class:`SnapshotError` if unusable.

    ``table_type`` is the class built (a :class:`~balancer.index.locked.LockedPrefixTable` for a
    table two threads will share); it is filled before anyone else can see it."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SnapshotError("not a kvlb table snapshot")
    view = memoryview(data)
    at = len(MAGIC)
    (size,) = _U32.unpack_from(data, at)
    at += 4
    try:
        header: dict[str, Any] = msgpack.unpackb(view[at : at + size], raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SnapshotError(f"bad snapshot header: {exc}") from exc
    at += size
    theirs = (header.get("model"), header.get("bs"), header.get("mode"))
    if theirs != (hasher.model, hasher.block_size, hasher.mode):
        raise SnapshotError(f"snapshot is of key space {theirs}, not {hasher}")
    table = table_type(hasher, limits)
    count = int(header["keys"])
    keys, at = _read(view, at, "Q", count)
    index, at = _read(view, at, "I", count)
    new_caches: list[CacheSlot] = []
    for replica, rank, held, size_keys, dups in header["caches"]:
        cache = table._slots.new_cache(ReplicaId(replica), int(rank))
        if cache is None:
            raise SnapshotError("snapshot has more caches than this table's max_slots")
        hashes, at = _read(view, at, "Q", size_keys)
        values, at = _read(view, at, "Q", size_keys)
        cache.keys = dict(zip(hashes, values, strict=True))
        cache.dups = {int(k): int(v) for k, v in dups}
        cache.held = int(held)
        new_caches.append(cache)
    roots, at = _read(view, at, "Q", int(header.get("roots", 0)))
    if at != len(data):
        raise SnapshotError(f"snapshot has {len(data) - at} trailing bytes")
    masks = [_positions_to_bits(positions, new_caches) for positions in header["sets"]]
    table._holders = dict(zip(keys, map(masks.__getitem__, index), strict=True))
    table._relist_roots(roots)
    if len(table._holders) > table.limits.capacity_blocks:
        table._evict()
    return TableSnapshot(table, int(header["n"]), str(header["id"]), bool(header["partial"]))


def _bits_to_positions(mask: int, position: dict[int, int]) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        mask ^= low
        out.append(position[low])
    return out


def _positions_to_bits(positions: list[int], caches: list[CacheSlot]) -> int:
    mask = 0
    for i in positions:
        mask |= caches[i].bit
    return mask


def _le(values: array[int]) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _read(view: memoryview, at: int, typecode: str, count: int) -> tuple[array[int], int]:
    values = array(typecode)
    end = at + values.itemsize * count
    if end > len(view):
        raise SnapshotError("snapshot is truncated")
    values.frombytes(view[at:end])
    if sys.byteorder != "little":  # pragma: no cover
        values.byteswap()
    return values, end
