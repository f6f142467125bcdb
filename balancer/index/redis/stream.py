"""Entries of a pool's applied-event stream (pure: encode and decode, no I/O).

``APPLY`` appends every accepted batch to the pool's Redis Stream in the same atomic call, so the
stream's order is exactly the order in which Redis applied the batches, across every writer.
Mirrors replay it into a local :class:`~balancer.index.memory.MemoryIndex`, which has the same
semantics as the Redis index and so reaches the same state.

Stream entry fields (bytes):

* ``r``: the replica.
* ``n``: the entry's number, consecutive across the pool (1, 2, ...). A jump means entries were
  trimmed (``MAXLEN ~``, or ``MINID`` by the byte bound ``stream_max_bytes``) before the reader
  saw them.
* ``g``: the stream's epoch, the Redis server's ``TIME`` in microseconds (digits) when its numbering
  started (``ctr.stream_epoch``). Another value means the stream restarted (a ``FLUSHALL``, a restart
  without data) even where its IDs and numbers look like a continuation. Absent in entries written
  by a release before 2026-12-01.
* ``e``: the normalised event batch as the writer passed it, in msgpack. Keys are not included:
  the reader hashes the tokens itself.
* ``d``: present, value ``1``, instead of ``e`` when the replica was dropped.
* ``x``: instead of ``e``, the block keys (16 hex digits each, concatenated) whose real holdings the
  replica lost (``RedisIndex.drop_blocks``: receipts).

Each event is a msgpack array:

* ``[0, dp_rank, parent|nil, [engine hashes], tokens, block_size, lookahead, lora|nil, salt|nil]``
  for ``Stored``.
* ``[1, dp_rank, [engine hashes]]`` for ``Removed``.
* ``[2, dp_rank]`` for ``Cleared``.
* ``[3, dp_rank, reason]`` for ``Resync``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgpack

from balancer.errors import EventDecodeError
from balancer.events import Cleared, KvEvent, Removed, Resync, ResyncReason, Stored
from balancer.types import BlockKey, EngineHash, ReplicaId

_STORED, _REMOVED, _CLEARED, _RESYNC = 0, 1, 2, 3


def encode_batch(events: Sequence[KvEvent]) -> bytes:
    """One batch as the ``e`` field of a stream entry."""
    out: list[list[Any]] = []
    for event in events:
        if type(event) is Stored:
            out.append(
                [
                    _STORED,
                    event.dp_rank,
                    event.parent,
                    list(event.engine_hashes),
                    event.tokens,
                    event.block_size,
                    event.lookahead_tokens,
                    event.lora_name,
                    event.cache_salt,
                ]
            )
        elif type(event) is Removed:
            out.append([_REMOVED, event.dp_rank, list(event.engine_hashes)])
        elif type(event) is Cleared:
            out.append([_CLEARED, event.dp_rank])
        elif type(event) is Resync:
            out.append([_RESYNC, event.dp_rank, event.reason])
    return cast(bytes, msgpack.packb(out, use_bin_type=True))


def decode_batch(payload: bytes) -> list[KvEvent]:
    """The events of an ``e`` field; raises :class:`EventDecodeError` on a malformed payload."""
    try:
        raw = msgpack.unpackb(payload, raw=False)
        return [_decode_event(item) for item in raw]
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise EventDecodeError("stream", f"bad stream batch: {exc}") from exc


def _decode_event(item: list[Any]) -> KvEvent:
    tag = item[0]
    if tag == _STORED:
        parent = None if item[2] is None else EngineHash(int(item[2]))
        hashes = tuple(EngineHash(int(h)) for h in item[3])
        return Stored(item[1], parent, hashes, bytes(item[4]), item[5], item[6], item[7], item[8])
    if tag == _REMOVED:
        return Removed(item[1], tuple(EngineHash(int(h)) for h in item[2]))
    if tag == _CLEARED:
        return Cleared(item[1])
    if tag == _RESYNC:
        return Resync(item[1], cast(ResyncReason, item[2]))
    raise ValueError(f"unknown event tag {tag!r}")


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One decoded stream entry: a batch of ``replica`` (empty when ``dropped``)."""

    entry_id: str
    number: int
    replica: ReplicaId
    events: list[KvEvent]
    dropped: bool
    dropped_keys: tuple[BlockKey, ...] = ()
    """Keys whose real holdings ``replica`` lost (``x``); empty otherwise."""
    epoch: bytes | None = None
    """The stream's epoch (``g``), ``None`` in an entry of an older release."""


def decode_entry(entry_id: bytes | str, fields: Mapping[bytes, bytes]) -> StreamEntry:
    """A raw ``XREAD``/``XRANGE`` entry (read with ``decode_responses=False``)."""
    try:
        replica = ReplicaId(fields[b"r"].decode())
        number = int(fields[b"n"])
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise EventDecodeError("stream", f"bad stream entry {entry_id!r}: {exc}") from exc
    text_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    epoch = fields.get(b"g")
    if b"d" in fields:
        return StreamEntry(text_id, number, replica, [], True, epoch=epoch)
    if b"x" in fields:
        return StreamEntry(text_id, number, replica, [], False, _decode_keys(entry_id, fields[b"x"]), epoch)
    return StreamEntry(text_id, number, replica, decode_batch(fields.get(b"e", b"\x90")), False, epoch=epoch)


def _decode_keys(entry_id: bytes | str, joined: bytes) -> tuple[BlockKey, ...]:
    if len(joined) % 16:
        raise EventDecodeError("stream", f"bad stream entry {entry_id!r}: keys of {len(joined)} hex digits")
    try:
        return tuple(BlockKey(int(joined[i : i + 16], 16)) for i in range(0, len(joined), 16))
    except ValueError as exc:
        raise EventDecodeError("stream", f"bad stream entry {entry_id!r}: {exc}") from exc


def entry_number(fields: object) -> int | None:
    """The ``n`` field of a raw entry, ``None`` when absent or not a number (then ``APPLY`` did not
    write the entry, so it carried no batch)."""
    value = fields.get(b"n") if isinstance(fields, Mapping) else None
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None
