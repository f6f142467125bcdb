"""The ``PrefixIndex`` contract (balancer/index/base.py), run on every backend.

A backend is added by one line in ``FACTORIES``: an async function that takes the pool's
``BlockHasher`` and a block budget and returns a fresh, empty index (closed by the fixture).
The backends: the in-memory index, the Redis index, and the fleet mirror (``MirroredIndex`` in
``tests/redis_server.py``: writes go through a ``RedisIndex``, then the mirror polls the stream;
reads and speculative entries are the mirror's), and that mirror as fleet mode runs it (``mirror-thread``:
it tails the stream on an ingest thread, the suite reads the table it installed on the suite's loop).
Events carry tokens and the index computes keys; requests are hashed with ``BlockHasher.request_keys``,
so every match below also checks that both sides derive the same keys.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import pytest
from redis_server import (  # a private redis-server per session (tests/conftest.py)
    mirror_index,
    redis_index,
    threaded_mirror_index,
)

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.index.base import ApplyResult, PrefixIndex
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.locked import LockedPrefixTable
from balancer.index.memory import MemoryIndex
from balancer.index.slots import TableLimits
from balancer.types import EngineHash, ReplicaId

IndexFactory = Callable[[BlockHasher, int], Awaitable[PrefixIndex]]


async def _memory(hasher: BlockHasher, capacity_blocks: int) -> PrefixIndex:
    return MemoryIndex.with_capacity(hasher, capacity_blocks)


async def _locked(hasher: BlockHasher, capacity_blocks: int) -> PrefixIndex:
    """The table ingestion shares with the request loop; a tiny slice so every apply is cut up."""
    table = LockedPrefixTable(hasher, TableLimits(capacity_blocks=capacity_blocks), apply_slice_blocks=2)
    return MemoryIndex.over(table)


FACTORIES: dict[str, IndexFactory] = {
    "memory": _memory,
    "locked": _locked,
    "redis": redis_index,
    "mirror": mirror_index,
    "mirror-thread": threaded_mirror_index,
}

BS = 4
PLAIN = BlockHasher("model-a", BS)
A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
MakeIndex = Callable[..., Awaitable[PrefixIndex]]


@pytest.fixture(params=sorted(FACTORIES))
async def make_index(request: pytest.FixtureRequest) -> AsyncIterator[MakeIndex]:
    made: list[PrefixIndex] = []

    async def make(hasher: BlockHasher = PLAIN, capacity_blocks: int = 100_000) -> PrefixIndex:
        index = await FACTORIES[request.param](hasher, capacity_blocks)
        made.append(index)
        return index

    yield make
    for index in made:
        await index.aclose()


def toks(blocks: int, first: int = 1, block_size: int = BS) -> list[int]:
    """``blocks`` full blocks of distinct token ids starting at ``first``."""
    return list(range(first, first + blocks * block_size))


def hashes(*values: int) -> tuple[EngineHash, ...]:
    return tuple(EngineHash(v) for v in values)


def stored(
    tokens: Sequence[int],
    engine: Sequence[int],
    parent: int | None = None,
    dp_rank: int = 0,
    block_size: int = BS,
    **namespace: str,
) -> Stored:
    return Stored(
        dp_rank,
        None if parent is None else EngineHash(parent),
        hashes(*engine),
        pack_tokens(tokens),
        block_size,
        lora_name=namespace.get("lora_name"),
        cache_salt=namespace.get("cache_salt"),
    )


async def apply(index: PrefixIndex, replica: ReplicaId, *events: KvEvent, now: float = 0.0) -> ApplyResult:
    return await index.apply(replica, list(events), now)


async def overlap(
    index: PrefixIndex, tokens: Sequence[int], among: Sequence[ReplicaId] | None = None, now: float = 0.0
) -> dict[ReplicaId, int]:
    result = await index.match(PLAIN.request_keys(tokens), among, now)
    return result.blocks


async def test_store_then_match_counts_leading_blocks(make_index: MakeIndex) -> None:
    index = await make_index()
    result = await apply(index, A, stored(toks(4), [11, 12, 13, 14]))
    assert result.stored_blocks == 4
    assert await overlap(index, toks(6)) == {A: 4}
    assert await overlap(index, toks(2) + [999] * BS + toks(2, 9)) == {A: 2}
    assert await overlap(index, toks(1, 5000)) == {A: 0}
    full = await index.match(PLAIN.request_keys([*toks(6), 1]), None, 0.0)
    assert full.request_blocks == 6


async def test_child_chains_from_its_parent(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(2), [1, 2]), stored(toks(2, 9), [3, 4], parent=2))
    assert await overlap(index, toks(4)) == {A: 4}
    # the child's tokens alone, from the root, are a different prefix
    assert await overlap(index, toks(2, 9)) == {A: 0}


async def test_unknown_parent_skips_the_whole_store(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(2), [1, 2], dp_rank=0))
    result = await apply(
        index, A, stored(toks(2, 9), [3, 4], parent=77), stored(toks(2, 9), [5, 6], parent=2, dp_rank=1)
    )
    assert result.skipped_unknown_parent == 2  # parents are per (replica, dp_rank)
    assert result.stored_blocks == 0
    assert await overlap(index, toks(4)) == {A: 2}


async def test_remove_stops_the_walk_and_counts_unknown(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(4), [1, 2, 3, 4]))
    result = await apply(index, A, Removed(0, hashes(3, 404)), Removed(1, hashes(1)))
    assert result.removed_blocks == 1
    assert result.unknown_removals == 2
    assert await overlap(index, toks(4)) == {A: 2}


async def test_restore_is_idempotent(make_index: MakeIndex) -> None:
    index = await make_index()
    event = stored(toks(3), [1, 2, 3])
    await apply(index, A, event)
    await apply(index, A, event)
    stats = await index.stats()
    assert (stats.unique_blocks, stats.held_blocks) == (3, 3)
    await apply(index, A, Removed(0, hashes(1, 2, 3)))
    assert await overlap(index, toks(3)) == {A: 0}


@pytest.mark.parametrize("event", [Cleared(0), Resync(0, "gap")])
async def test_clear_and_resync_empty_one_rank_only(make_index: MakeIndex, event: KvEvent) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(3), [1, 2, 3], dp_rank=0), stored(toks(2), [1, 2], dp_rank=1))
    await apply(index, B, stored(toks(3), [1, 2, 3]))
    result = await apply(index, A, event)
    assert (result.cleared_caches, result.resyncs) == ((1, 0) if isinstance(event, Cleared) else (0, 1))
    assert await overlap(index, toks(3)) == {A: 2, B: 3}
    again = await apply(index, A, stored(toks(1, 5000), [9], parent=3, dp_rank=0))
    assert again.skipped_unknown_parent == 1  # the rank's engine-hash map went too
    assert (await index.stats()).blocks_by_replica[A] == 2


async def test_drop_replica_forgets_every_rank(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(3), [1, 2, 3], dp_rank=0), stored(toks(2), [1, 2], dp_rank=1))
    await apply(index, B, stored(toks(2), [1, 2]))
    assert await index.drop_replica(A) == 5
    assert await overlap(index, toks(3)) == {B: 2}
    assert await index.drop_replica(A) == 0
    stats = await index.stats()
    assert (stats.unique_blocks, stats.held_blocks) == (2, 2)
    assert A not in stats.blocks_by_replica


async def test_overlap_is_the_best_rank(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(2), [1, 2], dp_rank=0), stored(toks(4), [1, 2, 3, 4], dp_rank=3))
    result = await index.match(PLAIN.request_keys(toks(5)), None, 0.0)
    assert result.blocks == {A: 4}
    assert result.best_rank[A] == 3


async def test_among_restricts_and_lists_every_replica_asked(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(4), [1, 2, 3, 4]))
    await apply(index, B, stored(toks(2), [1, 2]))
    assert await overlap(index, toks(4), among=[B, C]) == {B: 2, C: 0}
    assert await overlap(index, toks(4), among=[]) == {}
    assert await overlap(index, toks(4)) == {A: 4, B: 2}


async def test_speculative_entries_count_until_they_expire(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(1), [1]))
    await index.add_speculative(B, PLAIN.request_keys(toks(3)), ttl_s=2.0, now=10.0)
    assert await overlap(index, toks(4), among=[A, B], now=11.9) == {A: 1, B: 3}
    assert (await index.stats()).speculative_entries == 3
    assert await overlap(index, toks(4), among=[A, B], now=12.0) == {A: 1, B: 0}
    assert (await index.stats()).speculative_entries == 0


async def test_a_real_store_confirms_a_speculative_entry(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.add_speculative(A, PLAIN.request_keys(toks(3)), ttl_s=1.0, now=0.0)
    await apply(index, A, stored(toks(2), [1, 2]), now=0.5)
    assert await overlap(index, toks(3), now=5.0) == {A: 2}  # the stored two stay, the third expired
    stats = await index.stats()
    assert (stats.speculative_entries, stats.held_blocks) == (0, 2)


async def test_speculative_extension_and_drop(make_index: MakeIndex) -> None:
    index = await make_index()
    keys = PLAIN.request_keys(toks(2))
    await index.add_speculative(A, keys, ttl_s=1.0, now=0.0)
    await index.add_speculative(A, keys[:1], ttl_s=5.0, now=0.5)
    assert await overlap(index, toks(2), now=2.0) == {A: 1}
    await index.drop_replica(A)
    assert await overlap(index, toks(2), among=[A], now=2.0) == {A: 0}


async def test_budget_evicts_least_recently_stored(make_index: MakeIndex) -> None:
    index = await make_index(capacity_blocks=8)
    await apply(index, A, stored(toks(4, 100), [1, 2, 3, 4]))
    await apply(index, B, stored(toks(4, 200), [5, 6, 7, 8]))
    await apply(index, B, stored(toks(4, 100), [1, 2, 3, 4]))  # touches the first chain
    result = await apply(index, C, stored(toks(4, 300), [9, 10, 11, 12]))
    assert result.evicted_blocks == 4
    assert await overlap(index, toks(4, 200)) == {A: 0, B: 0, C: 0}
    assert await overlap(index, toks(4, 100)) == {A: 4, B: 4, C: 0}
    assert await overlap(index, toks(4, 300)) == {A: 0, B: 0, C: 4}
    stats = await index.stats()
    assert stats.unique_blocks == 8 and stats.capacity_blocks == 8
    assert stats.blocks_by_replica == {A: 4, B: 4, C: 4}


async def test_namespaces_never_share_keys(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(2), [1, 2], lora_name="lora-x"))
    await apply(index, B, stored(toks(2), [1, 2], cache_salt="tenant-1"))
    assert await overlap(index, toks(2)) == {A: 0, B: 0}
    lora = await index.match(PLAIN.request_keys(toks(2), lora_name="lora-x"), None, 0.0)
    salted = await index.match(PLAIN.request_keys(toks(2), cache_salt="tenant-1"), None, 0.0)
    assert (lora.blocks, salted.blocks) == ({A: 2, B: 0}, {A: 0, B: 2})
    # a child inherits its root's namespace through the chained key
    await apply(index, A, stored(toks(1, 50), [3], parent=2))
    deeper = await index.match(PLAIN.request_keys(toks(2) + toks(1, 50), lora_name="lora-x"), None, 0.0)
    assert deeper.blocks[A] == 3


async def test_block_size_mismatch_is_skipped_and_counted(make_index: MakeIndex) -> None:
    index = await make_index()
    result = await apply(index, A, stored(toks(2, block_size=8), [1, 2], block_size=8))
    assert result.skipped_block_size_mismatch == 1 and result.stored_blocks == 0
    assert (await index.stats()).unique_blocks == 0


async def test_bigram_pages_use_one_lookahead_token(make_index: MakeIndex) -> None:
    bigram = BlockHasher("model-a", BS, "bigram")
    index = await make_index(hasher=bigram)
    prompt = [*toks(3), 7]  # 13 tokens: three pages of four pairs
    event = Stored(0, None, hashes(1, 2, 3), pack_tokens(prompt), BS, lookahead_tokens=1)
    assert (await apply(index, A, event)).stored_blocks == 3
    result = await index.match(bigram.request_keys([*prompt, 8, 9]), None, 0.0)
    assert result.blocks == {A: 3}
    other = await index.match(bigram.request_keys([*toks(3), 6]), None, 0.0)
    assert other.blocks == {A: 2}  # the lookahead token is part of the last page
    plain_event = stored(toks(2), [4, 5])
    assert (await apply(index, B, plain_event)).skipped_block_size_mismatch == 1


async def test_trtllm_requests_leave_out_the_last_token(make_index: MakeIndex) -> None:
    trtllm = BlockHasher("model-a", BS, "trtllm")
    index = await make_index(hasher=trtllm)
    await apply(index, A, stored(toks(2), [1, 2]))
    assert (await index.match(trtllm.request_keys(toks(2)), None, 0.0)).blocks == {A: 1}
    assert (await index.match(trtllm.request_keys([*toks(2), 0]), None, 0.0)).blocks == {A: 2}


async def test_stats_count_unique_and_held_blocks(make_index: MakeIndex) -> None:
    index = await make_index(capacity_blocks=1000)
    await apply(index, A, stored(toks(3), [1, 2, 3]))
    await apply(index, B, stored(toks(2), [1, 2]), stored(toks(1, 40), [9]))
    stats = await index.stats()
    assert (stats.unique_blocks, stats.held_blocks) == (4, 6)
    assert stats.blocks_by_replica == {A: 3, B: 3}
    assert stats.capacity_blocks == 1000
    assert stats.bytes_per_block is None or stats.bytes_per_block > 0


async def test_drop_blocks_forgets_one_replicas_holdings_past_a_point(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(4), [1, 2, 3, 4], dp_rank=0), stored(toks(3), [1, 2, 3], dp_rank=1))
    await apply(index, B, stored(toks(4), [1, 2, 3, 4]))
    keys = PLAIN.request_keys(toks(4))
    assert await index.drop_blocks(A, keys[2:]) == 3  # blocks 2..3 on rank 0, block 2 on rank 1
    assert await overlap(index, toks(4)) == {A: 2, B: 4}
    stats = await index.stats()
    assert (stats.unique_blocks, stats.blocks_by_replica) == (4, {A: 4, B: 4})
    assert await index.drop_blocks(A, keys[2:]) == 0  # nothing left to drop
    assert await index.drop_blocks(C, keys) == 0  # an unknown replica


async def test_drop_blocks_keeps_speculative_entries_and_lets_stores_come_back(make_index: MakeIndex) -> None:
    index = await make_index()
    await apply(index, A, stored(toks(3), [1, 2, 3]))
    keys = PLAIN.request_keys(toks(3))
    await index.add_speculative(A, keys[:2], ttl_s=5.0, now=0.0)
    assert await index.drop_blocks(A, keys) == 3
    assert await overlap(index, toks(3), now=1.0) == {A: 2}  # the speculative two stay
    assert await overlap(index, toks(3), now=6.0) == {A: 0}
    # a child still chains from a dropped parent, a removal of a dropped block is ignored,
    # and storing a dropped block holds it again
    again = await apply(index, A, stored(toks(1, 1 + 3 * BS), [4], parent=3), now=6.0)
    assert again.skipped_unknown_parent == 0
    removal = await apply(index, A, Removed(0, hashes(3)), now=6.0)
    assert removal.removed_blocks == 0
    await apply(index, A, stored(toks(3), [1, 2, 3]), now=6.0)
    assert await overlap(index, toks(4), now=6.0) == {A: 4}
    assert (await index.stats()).blocks_by_replica == {A: 4}


async def test_drop_blocks_of_the_last_holder_frees_the_key(make_index: MakeIndex) -> None:
    index = await make_index(capacity_blocks=4)
    await apply(index, A, stored(toks(4), [1, 2, 3, 4]))
    assert await index.drop_blocks(A, PLAIN.request_keys(toks(4))) == 4
    assert (await index.stats()).unique_blocks == 0
    await apply(index, B, stored(toks(4, 100), [5, 6, 7, 8]))  # fits the budget: nothing evicted
    assert await overlap(index, toks(4, 100)) == {A: 0, B: 4}


@pytest.mark.parametrize("loss", ["cleared", "removed", "resync"])
async def test_a_confirmed_speculative_entry_outlives_a_loss_of_the_real_copy(
    make_index: MakeIndex, loss: str
) -> None:
    """A request routed to A holds its blocks speculatively; a store of them (a replay of A's older
    history, or the engine's own) confirms them, and a clear or removal of that real copy after it
    (the replayed history's end, an eviction the request's prefill undoes) leaves the request's
    entry to its own expiry."""
    index = await make_index()
    await index.add_speculative(A, PLAIN.request_keys(toks(3)), ttl_s=5.0, now=0.0)
    await apply(index, A, stored(toks(3), [1, 2, 3]), now=0.5)
    stats = await index.stats()
    assert (stats.held_blocks, stats.speculative_entries) == (3, 3)  # real and speculative both
    gone: KvEvent = {"cleared": Cleared(0), "removed": Removed(0, hashes(2)), "resync": Resync(0, "gap")}[
        loss
    ]
    await apply(index, A, gone, now=0.6)
    assert await overlap(index, toks(4), now=1.0) == {A: 3}
    stats = await index.stats()
    assert stats.speculative_entries == 3 and stats.held_blocks == (0 if loss != "removed" else 2)
    assert await overlap(index, toks(4), now=5.0) == {A: 0 if loss != "removed" else 1}
    assert (await index.stats()).speculative_entries == 0


async def test_a_confirmed_speculative_entry_goes_with_its_replica(make_index: MakeIndex) -> None:
    index = await make_index()
    await index.add_speculative(A, PLAIN.request_keys(toks(3)), ttl_s=5.0, now=0.0)
    await apply(index, A, stored(toks(3), [1, 2, 3]), Cleared(0), now=0.5)
    assert await overlap(index, toks(3), now=1.0) == {A: 3}
    await index.drop_replica(A)
    assert await overlap(index, toks(3), among=[A], now=1.0) == {A: 0}
    assert (await index.stats()).speculative_entries == 0


async def test_drop_blocks_of_a_confirmed_key_keeps_its_speculative_entry(make_index: MakeIndex) -> None:
    index = await make_index()
    keys = PLAIN.request_keys(toks(3))
    await index.add_speculative(A, keys, ttl_s=5.0, now=0.0)
    await apply(index, A, stored(toks(3), [1, 2, 3]), now=0.5)
    assert await index.drop_blocks(A, keys) == 3  # the real holdings
    assert await overlap(index, toks(3), now=1.0) == {A: 3}  # the request's entry stays
    assert (await index.stats()).held_blocks == 0
    assert await overlap(index, toks(3), now=5.0) == {A: 0}


async def test_held_keys_list_each_ranks_real_blocks_only(make_index: MakeIndex) -> None:
    index = await make_index()
    keys = PLAIN.request_keys(toks(4))
    other = PLAIN.request_keys(toks(2, 100))
    await apply(index, A, stored(toks(4), [11, 12, 13, 14]), stored(toks(2, 100), [21, 22], dp_rank=1))
    await apply(index, A, Removed(0, hashes(14)))
    await index.add_speculative(A, PLAIN.request_keys(toks(3, 500)), ttl_s=10.0, now=0.0)  # not listed
    await apply(index, B, stored(toks(4), [31, 32, 33, 34]))  # another replica's: not listed
    listed = await index.held_keys(A, 100)
    assert [(h.dp_rank, h.held_blocks, sorted(h.keys), h.truncated) for h in listed] == [
        (0, 3, sorted(keys[:3]), False),
        (1, 2, sorted(other), False),
    ]
    capped = await index.held_keys(A, 2)
    assert [(h.held_blocks, len(h.keys), h.truncated) for h in capped] == [(3, 2, True), (2, 2, False)]
    assert set(capped[0].keys) <= set(keys[:3])
    assert await index.held_keys(C, 100) == []


async def test_held_keys_follow_clears_drops_and_duplicate_handles(make_index: MakeIndex) -> None:
    index = await make_index()
    keys = PLAIN.request_keys(toks(3))
    await apply(index, A, stored(toks(3), [1, 2, 3]), stored(toks(1), [9]))  # handle 9: the same tokens as 1
    assert [sorted(h.keys) for h in await index.held_keys(A, 100)] == [sorted(keys)]
    await index.drop_blocks(A, keys[2:])
    assert [sorted(h.keys) for h in await index.held_keys(A, 100)] == [sorted(keys[:2])]
    await apply(index, A, Cleared(0))
    assert [(h.held_blocks, h.keys) for h in await index.held_keys(A, 100)] == [(0, ())]  # the rank stays
    await apply(index, A, stored(toks(1), [5]))
    await index.drop_replica(A)
    assert await index.held_keys(A, 100) == []
