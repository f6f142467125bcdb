"""``PrefixTable`` after an event gap (``TableLimits.gap_hold_s``): suspect blocks, confirmed or dropped."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from balancer.events import Cleared, Removed, Resync, Stored
from balancer.index import recovery
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.types import BlockKey, EngineHash, ReplicaId

BS = 2
HASHER = BlockHasher("m", BS)
A, B = ReplicaId("a"), ReplicaId("b")
HOLD_S = 1.0


def toks(blocks: int, first: int = 1) -> list[int]:
    return list(range(first, first + blocks * BS))


def stored(tokens: Sequence[int], engine: Sequence[int], parent: int | None = None) -> Stored:
    return Stored(
        0,
        None if parent is None else EngineHash(parent),
        tuple(EngineHash(h) for h in engine),
        pack_tokens(tokens),
        BS,
    )


def table(hold_s: float = HOLD_S) -> PrefixTable:
    return PrefixTable(HASHER, TableLimits(gap_hold_s=hold_s))


def gap(t: PrefixTable, now: float, replica: ReplicaId = A) -> None:
    t.apply(replica, [Resync(0, "gap")], now)


def test_hold_is_validated() -> None:
    with pytest.raises(ValueError):
        TableLimits(gap_hold_s=-1.0)
    with pytest.raises(ValueError):
        TableLimits(gap_hold_s=float("inf"))


def test_without_a_hold_a_gap_clears_at_once() -> None:
    t = table(hold_s=0.0)
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.0)
    gap(t, 1.0)
    assert t.held_blocks(A) == 0
    assert t.suspect_blocks(A) == 0


def test_a_gap_keeps_the_blocks_as_suspect_and_drops_the_unconfirmed_at_the_end_of_the_hold() -> None:
    t = table()
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.0)
    t.apply(A, [stored(toks(2, 100), [11, 12])], 0.0)
    gap(t, 1.0)
    assert t.held_blocks(A) == 5 and t.suspect_blocks(A) == 5
    assert t.match(HASHER.request_keys(toks(3)), None, 1.5).blocks[A] == 3  # still routed to
    t.apply(A, [stored(toks(3), [1, 2, 3])], 1.5)  # stored again: confirmed
    assert t.suspect_blocks(A) == 2
    t.apply(A, [], 2.0)  # the hold ends (1.0 + 1.0): the unconfirmed two go
    assert t.held_blocks(A) == 3
    assert t.engine_hashes(A) == {1, 2, 3}
    assert t.counters.suspect_marked == 5
    assert t.counters.suspect_confirmed == 3
    assert t.counters.suspect_dropped == 2


def test_a_store_under_a_suspect_parent_confirms_the_parent_and_chains_from_it() -> None:
    """The engine-hash map survives the gap: a child stored after it chains (a clear would skip it)."""
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    result = t.apply(A, [stored(toks(3)[2 * BS :], [3], parent=2)], 1.2)
    assert result.skipped_unknown_parent == 0
    t.apply(A, [], 2.5)
    # block 2 was confirmed by its child; block 1 was not (no receipt, no event named it)
    assert t.engine_hashes(A) == {2, 3}


def test_a_removal_after_the_gap_still_resolves() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    result = t.apply(A, [Removed(0, (EngineHash(2),))], 1.1)
    assert result.removed_blocks == 1 and result.unknown_removals == 0
    assert t.engine_hashes(A) == {1}


def test_receipts_confirm_the_found_keys_and_drop_the_missing_ones_at_once() -> None:
    t = table()
    t.apply(A, [stored(toks(4), [1, 2, 3, 4])], 0.0)
    gap(t, 1.0)
    keys = HASHER.request_keys(toks(4))
    # the engine found 2 blocks cached where the index predicted 4: 3 and 4 were evicted in the gap
    assert t.settle_suspect(A, keys[:2], keys[2:4], 1.1) == (2, 2)
    assert t.engine_hashes(A) == {1, 2}
    assert t.suspect_blocks(A) == 0
    t.apply(A, [], 5.0)
    assert t.engine_hashes(A) == {1, 2}  # confirmed: they outlive the hold


def test_receipts_touch_only_suspect_holdings_of_that_replica() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    t.apply(B, [stored(toks(2), [1, 2])], 0.0)
    keys = HASHER.request_keys(toks(2))
    assert t.settle_suspect(A, (), keys, 0.5) == (0, 0)  # no gap: nothing is suspect
    gap(t, 1.0, B)
    assert t.settle_suspect(A, (), keys, 1.1) == (0, 0)
    assert t.held_blocks(A) == 2
    assert t.settle_suspect(B, (), keys, 1.1) == (0, 2)
    assert t.held_blocks(B) == 0


def test_another_gap_makes_confirmed_blocks_suspect_again_and_restarts_the_hold() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    t.settle_suspect(A, HASHER.request_keys(toks(2)), (), 1.2)
    gap(t, 1.5)
    t.apply(A, [], 2.2)  # past the first gap's hold, inside the second's
    assert t.held_blocks(A) == 2
    t.apply(A, [], 2.5)
    assert t.held_blocks(A) == 0


def test_the_hold_also_ends_on_a_read() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    assert t.match(HASHER.request_keys(toks(2)), None, 2.0).blocks.get(A, 0) == 0


@pytest.mark.parametrize("event", [Resync(0, "restart"), Resync(0, "disconnect"), Cleared(0)])
def test_other_resyncs_and_clears_still_clear_suspects_too(event: Resync | Cleared) -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    t.apply(A, [event], 1.1)
    assert t.held_blocks(A) == 0 and t.suspect_blocks(A) == 0
    t.apply(A, [stored(toks(2), [1, 2])], 1.2)
    t.apply(A, [], 3.0)
    assert t.engine_hashes(A) == {1, 2}  # the earlier hold no longer applies


def test_dropping_the_replica_forgets_its_suspects() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    t.drop_replica(A)
    t.apply(A, [stored(toks(2), [1, 2])], 1.1)
    t.apply(A, [], 3.0)
    assert t.engine_hashes(A) == {1, 2}


def test_learn_blocks_checks_the_hashes_against_the_map_and_holds_them() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    keys = HASHER.request_keys(toks(4))
    assert t.learn_blocks(A, keys, [1, 2, 3, 4], 1.0, hold=False) == (2, 0, 0)
    assert t.learn_blocks(A, keys, [2, 1, 3, 4], 1.0, hold=True) == (0, 2, 0)  # other keys: refused
    assert t.learn_blocks(A, keys, [1, 2, 3, 4], 1.0, hold=True) == (2, 0, 2)
    assert t.engine_hashes(A) == {1, 2, 3, 4}
    assert t.apply(A, [Removed(0, (EngineHash(4),))], 2.0).removed_blocks == 1  # a real handle
    assert t.engine_hashes(A) == {1, 2, 3}


def test_learning_stops_at_a_block_removed_after_the_request_was_routed() -> None:
    t = table()
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.0)
    keys = HASHER.request_keys(toks(3))
    t.learn_blocks(A, keys, [1, 2, 3], 0.5, hold=False)  # the cache starts remembering removals
    t.apply(A, [Removed(0, (EngineHash(2), EngineHash(3)))], 2.0)
    # routed at 1.5, before the removal: the receipt's view may predate it; only block 1 is certain
    assert t.learn_blocks(A, keys, [1, 2, 3], 1.5, hold=True) == (1, 0, 0)
    assert t.engine_hashes(A) == {1}
    # routed at 2.5, after it: the engine found them cached again (their new stores were lost)
    assert t.learn_blocks(A, keys, [1, 2, 3], 2.5, hold=True) == (1, 0, 2)
    assert t.engine_hashes(A) == {1, 2, 3}


def test_learning_confirms_suspect_blocks_and_needs_a_single_rank() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t, 1.0)
    keys = HASHER.request_keys(toks(2))
    t.learn_blocks(A, keys, [1, 2], 0.5, hold=True)
    assert t.suspect_blocks(A) == 0
    two = PrefixTable(HASHER, TableLimits(gap_hold_s=HOLD_S))
    two.apply(A, [stored(toks(2), [1, 2]), Stored(1, None, (EngineHash(7),), pack_tokens(toks(1)), BS)], 0.0)
    assert two.learn_blocks(A, keys, [1, 2], 0.5, hold=True) == (0, 0, 0)


# ------------------------------------------------------------------ LRU frontier (gap_keep_s)

KEEP_S = 5.0


def lru_table(keep_s: float = KEEP_S) -> PrefixTable:
    return PrefixTable(HASHER, TableLimits(gap_hold_s=HOLD_S, gap_keep_s=keep_s))


def three_chains(t: PrefixTable) -> None:
    """Three chains of two blocks stored in order: engine hashes 1-2 (oldest), 11-12, 21-22."""
    t.apply(A, [stored(toks(2, 1), [1, 2])], 0.0)
    t.apply(A, [stored(toks(2, 100), [11, 12])], 0.1)
    t.apply(A, [stored(toks(2, 200), [21, 22])], 0.2)


def test_keep_is_validated() -> None:
    with pytest.raises(ValueError):
        TableLimits(gap_keep_s=-1.0)
    with pytest.raises(ValueError):
        TableLimits(gap_keep_s=float("inf"))


def test_a_post_gap_removal_of_a_suspect_drops_the_suspects_used_less_recently() -> None:
    """The engine evicts least recently used first: removing 11 means 1 and 2 went before it (their
    removals were lost in the gap); 12, 21 and 22 are more recent and stay suspect."""
    t = lru_table()
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [Removed(0, (EngineHash(11),))], 1.1)
    assert t.engine_hashes(A) == {12, 21, 22}
    assert t.suspect_blocks(A) == 3
    assert t.counters.suspect_frontier_dropped == 2
    assert t.counters.suspect_dropped == 2


def test_past_a_frontier_the_more_recent_suspects_outlive_the_hold_until_the_keep_limit() -> None:
    t = lru_table()
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [Removed(0, (EngineHash(1),))], 1.1)  # the oldest: a frontier, nothing older
    t.apply(A, [], 2.5)  # past the hold (1.0 + 1.0): kept, the engine's evictions have not reached them
    assert t.engine_hashes(A) == {2, 11, 12, 21, 22}
    t.apply(A, [Removed(0, (EngineHash(12),))], 3.0)  # the frontier moves on
    assert t.engine_hashes(A) == {21, 22}
    t.apply(A, [], 6.0)  # the keep limit (1.0 + 5.0): the unconfirmed rest goes
    assert t.held_blocks(A) == 0 and t.suspect_blocks(A) == 0


def test_without_a_frontier_the_hold_alone_applies() -> None:
    t = lru_table()
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [stored(toks(2, 200), [21, 22])], 1.5)  # confirmed; no eviction since the gap
    t.apply(A, [], 2.0)
    assert t.engine_hashes(A) == {21, 22}


def test_without_keep_a_removal_drops_only_its_own_block() -> None:
    t = table()
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [Removed(0, (EngineHash(12),))], 1.1)
    assert t.engine_hashes(A) == {1, 2, 11, 21, 22}
    assert t.counters.suspect_frontier_dropped == 0


def test_a_routed_request_makes_its_blocks_recently_used_before_and_after_the_gap() -> None:
    """Routing refreshes the table's order (before the gap) and the suspects' (after it): the oldest
    stored chain, routed to since, outlives a frontier at a block stored after it."""
    t = lru_table()
    three_chains(t)
    t.add_speculative(A, HASHER.request_keys(toks(2, 1)), 0.5, 0.5)  # chain 1-2 used before the gap
    gap(t, 1.0)
    t.add_speculative(A, HASHER.request_keys(toks(2, 100)), 0.5, 1.2)  # chain 11-12 after it
    t.apply(A, [Removed(0, (EngineHash(21),))], 1.3)  # now the least recently used of the three
    assert t.engine_hashes(A) == {1, 2, 11, 12, 22}
    t.apply(A, [Removed(0, (EngineHash(22), EngineHash(2)))], 1.4)
    # 1, 2's parent, counts as used at least as recently as 2 (a routed prompt refreshes its last
    # block first): a leaf-first engine evicts it after its child
    assert t.engine_hashes(A) == {1, 11, 12}
    t.apply(A, [Removed(0, (EngineHash(11),))], 1.5)  # a parent evicted: its child went first
    assert t.held_blocks(A) == 0


def test_a_keep_limit_within_the_hold_turns_the_frontier_off() -> None:
    t = PrefixTable(HASHER, TableLimits(gap_hold_s=HOLD_S, gap_keep_s=HOLD_S))
    assert not t.limits.lru_frontier and lru_table().limits.lru_frontier
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [Removed(0, (EngineHash(12),))], 1.1)
    assert t.engine_hashes(A) == {1, 2, 11, 21, 22}


# ------------------------------------------------------------------ blocks dropped unconfirmed


def dropped_after_the_hold(t: PrefixTable, blocks: int = 3) -> list[int]:
    """``blocks`` stored (engine hashes 1..), a gap at 1.0, the hold over at 2.0: all dropped
    unconfirmed. Returns the request keys of the chain."""
    t.apply(A, [stored(toks(blocks), list(range(1, blocks + 1)))], 0.0)
    gap(t, 1.0)
    t.apply(A, [], 2.0)
    assert t.held_blocks(A) == 0 and t.counters.suspect_dropped == blocks
    return HASHER.request_keys(toks(blocks))


def test_a_receipt_that_finds_blocks_dropped_unconfirmed_holds_them_again() -> None:
    """The guess was wrong: the engine still caches them, and it never stores a cached block again,
    so without the receipt they would stay unknown while the engine goes on using them."""
    t = table()
    keys = dropped_after_the_hold(t)
    assert t.settle_suspect(A, keys[:2], (), 2.5) == (2, 0)
    assert t.engine_hashes(A) == {1, 2}
    assert t.counters.suspect_restored == 2 and t.counters.suspect_confirmed == 0
    assert t.match(keys, None, 2.6).blocks[A] == 2
    result = t.apply(A, [Removed(0, (EngineHash(2),))], 3.0)  # its handle was kept: a removal resolves
    assert result.removed_blocks == 1 and t.engine_hashes(A) == {1}
    assert t.settle_suspect(A, keys[:2], (), 3.5) == (0, 0)  # once only


def test_a_store_under_a_block_dropped_unconfirmed_holds_that_parent_again() -> None:
    t = table()
    dropped_after_the_hold(t, 2)
    result = t.apply(A, [stored(toks(3)[2 * BS :], [3], parent=2)], 2.5)
    assert result.stored_blocks == 1
    assert t.engine_hashes(A) == {2, 3}  # 1 only a receipt can show
    assert t.counters.suspect_restored == 1


def test_a_block_removed_or_shown_missing_since_it_was_dropped_is_not_held_again() -> None:
    t = table()
    keys = dropped_after_the_hold(t)
    t.apply(A, [Removed(0, (EngineHash(3),))], 2.2)  # the engine evicted it: its handle goes
    assert t.settle_suspect(A, keys, (), 2.5) == (2, 0)
    assert t.engine_hashes(A) == {1, 2}
    t2 = table()
    t2.apply(A, [stored(toks(2), [1, 2])], 0.0)
    gap(t2, 1.0)
    assert t2.settle_suspect(A, keys[:1], keys[1:2], 1.5) == (1, 1)  # 2 shown missing: no guess
    t2.apply(A, [], 2.5)
    assert t2.settle_suspect(A, keys[:2], (), 3.0) == (0, 0)
    assert t2.engine_hashes(A) == {1}


def test_blocks_dropped_unconfirmed_are_forgotten_after_a_minute_a_clear_or_a_replica_drop() -> None:
    t = table()
    keys = dropped_after_the_hold(t)
    assert t.settle_suspect(A, keys, (), 62.0) == (0, 0)  # 60 s after the drop at 2.0
    for forget in (
        lambda t: t.apply(A, [Cleared(0)], 2.2),
        lambda t: t.apply(A, [Resync(0, "restart")], 2.2),
        lambda t: t.drop_replica(A),
    ):
        t = table()
        keys = dropped_after_the_hold(t)
        forget(t)
        assert t.settle_suspect(A, keys, (), 2.5) == (0, 0)
        assert t.held_blocks(A) == 0


def test_with_several_ranks_a_receipt_holds_nothing_dropped_again() -> None:
    """A receipt does not say which rank served it."""
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    t.apply(A, [Stored(1, None, (EngineHash(5),), pack_tokens(toks(1, 50)), BS)], 0.0)
    gap(t, 1.0)
    t.apply(A, [], 2.0)
    assert t.settle_suspect(A, HASHER.request_keys(toks(2)), (), 2.5) == (0, 0)
    assert t.held_blocks(A) == 1  # rank 1's block was not suspect (rank 0's gap)


def test_blocks_dropped_past_an_eviction_frontier_can_be_held_again() -> None:
    """The frontier is a guess from kvlb's order of use, which is not the engine's (one order for the
    whole table, routing refreshes it): a receipt that finds a block it dropped corrects it."""
    t = lru_table()
    three_chains(t)
    gap(t, 1.0)
    t.apply(A, [Removed(0, (EngineHash(11),))], 1.1)  # 1 and 2 dropped past the frontier
    assert t.engine_hashes(A) == {12, 21, 22}
    assert t.settle_suspect(A, HASHER.request_keys(toks(2, 1)), (), 1.2) == (2, 0)
    assert t.engine_hashes(A) == {1, 2, 12, 21, 22}


def test_compaction_keeps_the_handles_of_blocks_dropped_unconfirmed() -> None:
    """Dropping a whole large cache would otherwise compact its engine-hash map at once."""
    t = table()
    keys = dropped_after_the_hold(t, 100)
    assert t.settle_suspect(A, keys, (), 2.5) == (100, 0)
    assert t.engine_hashes(A) == set(range(1, 101))


# ------------------------------------------------------------------ stores under blocks the gap lost


def lost_prefix_then_child(t: PrefixTable, noted_at: float) -> tuple[list[int], list[BlockKey]]:
    """r0 held block 1; a gap at 1.0 lost the stores of a 3-block prefix (engine hashes 21..23); a
    request for that prefix plus one block is routed at ``noted_at`` (its engine hashes noted); the
    engine stores the request's last block (hash 24) under the lost hash 23. Returns the request's
    tokens and keys."""
    t.apply(A, [stored(toks(1, 900), [1])], 0.0)
    gap(t, 1.0)
    tokens = toks(4, 100)
    keys = list(HASHER.request_keys(tokens))
    if t.routes_wanted(A, noted_at):
        t.note_routes(A, keys, tokens, engine_hashes(21, 22, 23, 24), noted_at)
    return tokens, keys


def engine_hashes(*hashes: int) -> Callable[[Sequence[int], int], list[EngineHash]]:
    """A block hash function for one prompt: its full blocks hash to ``hashes`` in order."""
    return lambda tokens, bs: [EngineHash(h) for h in hashes[: len(tokens) // bs]]


def test_a_store_under_a_block_the_gap_lost_is_applied_when_a_routed_request_named_it() -> None:
    t = table()
    tokens, keys = lost_prefix_then_child(t, 1.2)
    result = t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 1.3)
    assert result.skipped_unknown_parent == 0 and result.stored_blocks == 1
    # the engine chains under 23: it holds 23 and its path to the root, under the engine's handles
    assert t.engine_hashes(A) >= {21, 22, 23, 24}
    assert t.match(keys, None, 1.3).blocks[A] == 4
    assert t.counters.routed_resolved == 1 and t.counters.routed_held == 3
    removed = t.apply(A, [Removed(0, (EngineHash(22),))], 1.4)
    assert removed.removed_blocks == 1 and removed.unknown_removals == 0


def test_a_routed_request_alone_holds_nothing() -> None:
    """Noting a request's blocks is no evidence that the engine holds them (it may compute them all)."""
    t = table()
    _, keys = lost_prefix_then_child(t, 1.2)
    assert t.held_prefix(A, keys) == 0
    assert t.engine_hashes(A) == {1}


def test_without_a_recent_gap_nothing_is_noted_and_the_store_is_skipped() -> None:
    t = table()
    assert not t.routes_wanted(A, 0.5)  # no cache yet, then no gap yet
    t.apply(A, [stored(toks(1, 900), [1])], 0.0)
    assert not t.routes_wanted(A, 0.5)
    tokens, _ = lost_prefix_then_child(t, 61.0)  # a minute after the gap: no longer noted
    result = t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 61.1)
    assert result.skipped_unknown_parent == 1
    assert t.engine_hashes(A) == set()  # block 1 went at the end of the hold
    t = table()
    tokens, _ = lost_prefix_then_child(t, 1.2)
    t.apply(A, [Cleared(0)], 1.25)  # a clear forgets what was noted, and the gap
    assert not t.routes_wanted(A, 1.3)
    assert t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 1.3).skipped_unknown_parent == 1


def test_routed_requests_are_bounded_oldest_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recovery, "ROUTED_PROMPTS", 1)
    t = table()
    tokens, _ = lost_prefix_then_child(t, 1.2)
    other = toks(2, 700)
    t.note_routes(A, HASHER.request_keys(other), other, engine_hashes(31, 32), 1.25)  # the first goes
    assert t.counters.routed_forgotten == 1
    assert t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 1.3).skipped_unknown_parent == 1
    monkeypatch.setattr(recovery, "ROUTED_PROMPTS", 256)
    monkeypatch.setattr(recovery, "ROUTED_TOKENS", 3 * BS)  # a prompt longer than the budget: not kept
    t = table()
    tokens, _ = lost_prefix_then_child(t, 1.2)
    assert t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 1.3).skipped_unknown_parent == 1


def test_a_child_whose_tokens_follow_another_block_of_the_prompt_is_not_chained_there() -> None:
    """The parent must be the block the engine names (its hash), not any block the child follows."""
    t = table()
    t.apply(A, [stored(toks(1, 900), [1])], 0.0)
    gap(t, 1.0)
    tokens = [*toks(1, 100), *toks(1, 200), *toks(1, 100), *toks(1, 200)]  # blocks x y x y
    t.note_routes(A, HASHER.request_keys(tokens), tokens, engine_hashes(21, 22, 23, 24), 1.2)
    result = t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 1.3)  # y under the third block
    assert result.skipped_unknown_parent == 0
    assert t.match(HASHER.request_keys(tokens), None, 1.3).blocks[A] == 4


def test_a_store_under_a_lost_block_holds_again_the_ancestors_dropped_unconfirmed() -> None:
    """The path to the root of a resolved parent: ancestors the hold dropped (the engine kept them)
    are held again. A store under a block merely dropped (its handle kept) is not resolved: only its
    direct parent is held again, as before routed requests were noted."""
    t = table()
    tokens = toks(4, 100)
    t.apply(A, [stored(tokens[: 2 * BS], [21, 22])], 0.0)
    gap(t, 1.0)
    t.apply(A, [], 2.1)  # the hold ended: both dropped unconfirmed
    assert t.engine_hashes(A) == set()
    t.note_routes(A, HASHER.request_keys(tokens), tokens, engine_hashes(21, 22, 23, 24), 2.2)
    t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 2.3)  # 23 was stored in the lost events
    assert t.engine_hashes(A) == {21, 22, 23, 24}
    t = table()
    t.apply(A, [stored(tokens[: 3 * BS], [21, 22, 23])], 0.0)
    gap(t, 1.0)
    t.apply(A, [], 2.1)
    t.note_routes(A, HASHER.request_keys(tokens), tokens, engine_hashes(21, 22, 23, 24), 2.2)
    t.apply(A, [stored(tokens[3 * BS :], [24], parent=23)], 2.3)
    assert t.engine_hashes(A) == {23, 24}
