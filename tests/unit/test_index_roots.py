"""``PrefixTable.held_roots``: how many prompt chains each replica's caches hold the root of.

A root is the first block of a ``Stored`` with no parent, or of a prompt routed to the replica
(``add_speculative``); a replica holding a root on two DP ranks, or both for real and
speculatively, counts it once. The count follows every way a block leaves a cache.
"""

from __future__ import annotations

from test_index_table import BS, HASHER, stored, toks

from balancer.events import Cleared, Removed, Resync
from balancer.index.locked import LockedPrefixTable
from balancer.index.slots import TableLimits
from balancer.index.snapshot import dump_table, load_table
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def table(capacity_blocks: int = 100_000) -> PrefixTable:
    return PrefixTable(HASHER, TableLimits(capacity_blocks=capacity_blocks))


def test_a_root_counts_once_per_chain_and_children_add_none() -> None:
    t = table()
    first, rest = toks(2), toks(2, first=100)
    t.apply(A, [stored(first, [1, 2])], 0.0)
    t.apply(A, [stored(rest, [3, 4], parent=2)], 0.0)  # the same chain goes on
    assert t.held_roots(None, 0.0) == {A: 1}
    t.apply(A, [stored(toks(3, first=500), [5, 6, 7])], 0.0)  # another prompt
    t.apply(B, [stored(first, [1, 2])], 0.0)
    assert t.held_roots(None, 0.0) == {A: 2, B: 1}
    assert t.held_roots((B, C), 0.0) == {B: 1, C: 0}


def test_one_block_events_chain_from_one_root() -> None:
    """SGLang publishes one ``BlockStored`` per page: only the first has no parent."""
    t = table()
    tokens = toks(4)
    t.apply(A, [stored(tokens[:BS], [1])], 0.0)
    for i in range(1, 4):
        t.apply(A, [stored(tokens[i * BS : (i + 1) * BS], [i + 1], parent=i)], 0.0)
    assert t.held_roots(None, 0.0) == {A: 1}


def test_ranks_and_speculation_of_the_same_root_count_once() -> None:
    t = table()
    tokens = toks(3)
    t.apply(A, [stored(tokens, [1, 2, 3], dp_rank=0), stored(tokens, [1, 2, 3], dp_rank=1)], 0.0)
    t.add_speculative(A, HASHER.request_keys(tokens + toks(1, first=90)), 5.0, 0.0)
    assert t.held_roots(None, 1.0) == {A: 1}


def test_a_routed_prompt_is_a_root_until_its_entry_expires() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    t.add_speculative(B, HASHER.request_keys(toks(3, first=40)), 5.0, 0.0)
    assert t.held_roots(None, 1.0) == {A: 1, B: 1}
    assert t.held_roots(None, 6.0) == {A: 1, B: 0}


def test_roots_leave_with_removal_clear_resync_drop_and_eviction() -> None:
    t = table()
    for replica in (A, B, C):
        t.apply(replica, [stored(toks(2), [1, 2]), stored(toks(2, first=50), [3, 4])], 0.0)
    t.apply(A, [Removed(0, (EngineHash(2),))], 0.0)  # the context's middle goes, its root may stay
    t.apply(B, [Cleared(0)], 0.0)
    t.apply(C, [Resync(0, "gap")], 0.0)
    assert t.held_roots(None, 0.0) == {A: 1, B: 0, C: 0}
    t.drop_blocks(A, HASHER.request_keys(toks(2, first=50)))
    assert t.held_roots((A,), 0.0) == {A: 0}
    t.apply(B, [stored(toks(2), [1, 2])], 0.0)
    t.drop_replica(B)
    assert t.held_roots((B,), 0.0) == {B: 0}


def test_eviction_takes_roots_with_their_blocks() -> None:
    t = table(capacity_blocks=256)
    for i in range(200):  # 200 one-block prompts, then 200 more: the first ones are evicted
        t.apply(A, [stored(toks(1, first=10 * i + 1), [i + 1])], 0.0)
    assert t.held_roots(None, 0.0) == {A: 200}
    for i in range(200, 400):
        t.apply(A, [stored(toks(1, first=10 * i + 1), [i + 1])], 0.0)
    held = t.held_blocks(A)
    assert held <= 256 and t.held_roots(None, 0.0) == {A: held}


def test_namespaces_have_their_own_roots() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2]), stored(toks(2), [3, 4], lora_name="tuned")], 0.0)
    assert t.held_roots(None, 0.0) == {A: 2}


def test_the_root_list_stays_bounded_as_prompts_come_and_go() -> None:
    t = table()
    for i in range(5_000):
        t.apply(A, [stored(toks(2, first=10 * i + 1), [2 * i + 1, 2 * i + 2])], 0.0)
        t.apply(A, [Removed(0, (EngineHash(2 * i + 1), EngineHash(2 * i + 2)))], 0.0)
        t.add_speculative(B, HASHER.request_keys(toks(1, first=10 * i + 1)), 1.0, float(i))
    assert t.held_roots(None, 5_000.0) == {A: 0, B: 0}
    assert t.roots_listed <= 64 + 1  # twice the live roots at the last pruning (none), plus slack


def test_a_snapshot_keeps_real_roots_and_leaves_speculative_ones_out() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2]), stored(toks(2, first=50), [3, 4])], 0.0)
    t.apply(B, [stored(toks(2), [1, 2])], 0.0)
    t.add_speculative(C, HASHER.request_keys(toks(2, first=80)), 5.0, 0.0)
    loaded = load_table(dump_table(t, 7, "7-0"), HASHER, table_type=LockedPrefixTable).table
    assert loaded.held_roots(None, 0.0) == {A: 2, B: 1}
    assert t.held_roots(None, 0.0) == {A: 2, B: 1, C: 1}
    loaded.apply(B, [stored(toks(2, first=50), [3, 4])], 0.0)  # the reloaded table goes on counting
    assert loaded.held_roots((B,), 0.0) == {B: 2}
