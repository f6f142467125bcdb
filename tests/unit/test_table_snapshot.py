"""Table snapshots: a reloaded table answers exactly like the original, without speculative holdings."""

from __future__ import annotations

import random

import msgpack
import pytest

from balancer.events import Cleared, KvEvent, Removed, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.locked import LockedPrefixTable
from balancer.index.slots import TableLimits
from balancer.index.snapshot import MAGIC, SnapshotError, dump_table, load_table
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 4
HASHER = BlockHasher("m", BS)
REPLICAS = [ReplicaId(f"r{i}") for i in range(4)]


def random_ops(rng: random.Random, table: PrefixTable, steps: int) -> list[list[int]]:
    """Random stores (chains sharing prefixes), removals and clears; returns the chains' tokens."""
    chains: list[list[int]] = []
    next_hash = 1
    stored_by: dict[tuple[ReplicaId, int], list[int]] = {}
    for _ in range(steps):
        replica = rng.choice(REPLICAS)
        rank = rng.randrange(2)
        known = stored_by.setdefault((replica, rank), [])
        roll = rng.random()
        events: list[KvEvent]
        if roll < 0.75 or not known:
            base = rng.choice(chains) if chains and rng.random() < 0.6 else []
            tokens = base[: rng.randrange(0, len(base) + 1) // BS * BS] + [
                rng.randrange(1000) for _ in range(BS * rng.randrange(1, 5))
            ]
            chains.append(tokens)
            count = len(tokens) // BS
            hashes = tuple(EngineHash(next_hash + i) for i in range(count))
            next_hash += count
            known.extend(hashes)
            events = [Stored(rank, None, hashes, pack_tokens(tokens), BS)]
        elif roll < 0.95:
            victim = known.pop(rng.randrange(len(known)))
            events = [Removed(rank, (EngineHash(victim),))]
        else:
            known.clear()
            events = [Cleared(rank)]
        table.apply(replica, events, 0.0)
    return chains


@pytest.mark.parametrize("table_type", [PrefixTable, LockedPrefixTable])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_reloaded_table_matches_original(seed: int, table_type: type[PrefixTable]) -> None:
    """``table_type``: the fleet mirror loads into a ``LockedPrefixTable`` (two threads share it)."""
    rng = random.Random(seed)
    limits = TableLimits(capacity_blocks=300)  # small: evictions happen, stale map entries remain
    original = PrefixTable(HASHER, limits)
    chains = random_ops(rng, original, 400)
    data = dump_table(original, 77, "123-4")
    snap = load_table(data, HASHER, limits, table_type=table_type)
    copy = snap.table
    assert type(copy) is table_type
    assert (snap.entry_number, snap.entry_id, snap.partial) == (77, "123-4", False)
    assert copy.stats().blocks_by_replica == original.stats().blocks_by_replica
    assert copy.stats().unique_blocks == original.stats().unique_blocks
    assert copy.held_roots(None, 0.0) == original.held_roots(None, 0.0)
    for tokens in chains:
        keys = HASHER.request_keys(tokens)
        assert copy.match(keys, None, 0.0) == original.match(keys, None, 0.0)
    # both keep evolving identically: same LRU order, same engine-hash maps
    more_rng = random.Random(seed + 100)
    chains2 = random_ops(more_rng, original, 200)
    random_ops(random.Random(seed + 100), copy, 200)
    for tokens in chains + chains2:
        keys = HASHER.request_keys(tokens)
        assert copy.match(keys, None, 0.0) == original.match(keys, None, 0.0)
    assert copy.held_roots(None, 0.0) == original.held_roots(None, 0.0)


def test_a_snapshot_from_before_roots_were_kept_loads_without_roots() -> None:
    """Snapshots written before the root list (no ``roots`` in the header, no array after the
    caches') still load: the table then counts the roots stored from then on."""
    table = PrefixTable(HASHER)
    first = list(range(1, 1 + 2 * BS))
    table.apply(REPLICAS[0], [Stored(0, None, (EngineHash(1), EngineHash(2)), pack_tokens(first), BS)], 0.0)
    data = dump_table(table, 3, "3-0")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = msgpack.unpackb(data[len(MAGIC) + 4 : len(MAGIC) + 4 + size], raw=False)
    assert header.pop("roots") == 1 and header.pop("markers") == 1
    packed = msgpack.packb(header, use_bin_type=True)
    old = MAGIC + len(packed).to_bytes(4, "little") + packed + data[len(MAGIC) + 4 + size : -16]
    copy = load_table(old, HASHER).table
    assert copy.match(HASHER.request_keys(first), None, 0.0).blocks == {REPLICAS[0]: 2}
    assert copy.held_roots(None, 0.0) == {REPLICAS[0]: 0}
    later = list(range(100, 100 + BS))
    copy.apply(REPLICAS[0], [Stored(0, None, (EngineHash(9),), pack_tokens(later), BS)], 0.0)
    assert copy.held_roots(None, 0.0) == {REPLICAS[0]: 1}


def test_speculative_holdings_are_left_out() -> None:
    table = PrefixTable(HASHER)
    real = list(range(1, 1 + 2 * BS))
    table.apply(REPLICAS[0], [Stored(0, None, (EngineHash(1), EngineHash(2)), pack_tokens(real), BS)], 0.0)
    spec_only = HASHER.request_keys(list(range(500, 500 + 3 * BS)))
    table.add_speculative(REPLICAS[1], spec_only, 60.0, 0.0)
    table.add_speculative(REPLICAS[0], HASHER.request_keys(real), 60.0, 0.0)
    copy = load_table(dump_table(table, 1, "1-0"), HASHER).table
    assert copy.stats().unique_blocks == 2 and copy.stats().speculative_entries == 0
    assert copy.match(spec_only, None, 0.0).blocks == {REPLICAS[0]: 0}
    assert copy.match(HASHER.request_keys(real), None, 0.0).blocks == {REPLICAS[0]: 2}


def test_other_key_space_and_garbage_are_refused() -> None:
    data = dump_table(PrefixTable(HASHER), 0, "0-0")
    with pytest.raises(SnapshotError):
        load_table(data, BlockHasher("m", BS * 2))
    with pytest.raises(SnapshotError):
        load_table(b"nonsense", HASHER)
    with pytest.raises(SnapshotError):
        load_table(data[:-1] if len(data) > 40 else data + b"x", HASHER)
