"""``PrefixTable.held_roots``: how many prompt chains each replica's caches hold the root of.

A root is the first block of a ``Stored`` with no parent, or of a prompt routed to the replica
(``add_speculative``); a replica holding a root on two DP ranks, or both for real and
speculatively, counts it once. The count follows every way a block leaves a cache.
"""

from __future__ import annotations

import msgpack
from test_index_table import BS, HASHER, stored, toks

from balancer.events import Cleared, Removed, Resync
from balancer.index.locked import LockedPrefixTable
from balancer.index.slots import TableLimits
from balancer.index.snapshot import MAGIC, dump_table, load_table
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


# A root counts while its replica holds the root's marker, a key halfway down its chain: a context
# evicted past its middle (LRU takes a chain's tail first) no longer counts, although its first
# blocks stay (issue #20: a tenant whose context moved on was counted by both its old home and its
# new one, and the charge stopped steering).

CONTEXT = toks(6)  # a 6-block prompt: engine hashes 1..6, its marker the 4th block (index 3)


def homed_then_evicted_from(keep: int) -> PrefixTable:
    """A stores CONTEXT, then its blocks past the first ``keep`` are removed (tail first)."""
    t = table()
    t.apply(A, [stored(CONTEXT, [1, 2, 3, 4, 5, 6])], 0.0)
    t.apply(A, [Removed(0, tuple(EngineHash(h) for h in range(6, keep, -1)))], 0.0)
    return t


def test_a_root_whose_tail_and_middle_are_evicted_stops_counting() -> None:
    t = homed_then_evicted_from(keep=2)
    assert t.match(HASHER.request_keys(CONTEXT), None, 0.0).blocks == {A: 2}  # its root stays
    assert t.held_roots(None, 0.0) == {A: 0}


def test_a_root_whose_tail_alone_is_evicted_still_counts() -> None:
    t = homed_then_evicted_from(keep=4)
    assert t.held_roots(None, 0.0) == {A: 1}


def test_a_context_that_moved_counts_at_its_new_home_only() -> None:
    """Part 19's stale count: the old home kept the first blocks, the prompt was routed elsewhere."""
    t = homed_then_evicted_from(keep=2)
    prompt = HASHER.request_keys(CONTEXT + toks(2, first=900))  # the context and a question
    t.add_speculative(B, prompt, 5.0, 0.0)
    assert t.held_roots(None, 1.0) == {A: 0, B: 1}
    t.apply(B, [stored(CONTEXT, [11, 12, 13, 14, 15, 16])], 1.0)  # its prefill stores it for real
    assert t.held_roots(None, 6.0) == {A: 0, B: 1}


def test_a_routed_prompt_counts_where_its_middle_is_held() -> None:
    """The routed prompt's middle key is the marker: a replica that stores only the prompt's first
    blocks (another prompt sharing them, or a partial prefill) does not home it."""
    t = table()
    prompt = HASHER.request_keys(toks(8, first=300))
    t.add_speculative(A, prompt, 5.0, 0.0)
    t.apply(B, [stored(toks(2, first=300), [1, 2])], 0.0)
    assert t.held_roots(None, 1.0) == {A: 1, B: 0}
    t.apply(B, [stored(toks(3, first=300 + 2 * BS), [3, 4, 5], parent=2)], 1.0)  # up to its middle
    assert t.held_roots(None, 1.0) == {A: 1, B: 1}
    assert t.held_roots(None, 6.0) == {A: 0, B: 1}


def test_a_snapshot_keeps_the_markers() -> None:
    t = homed_then_evicted_from(keep=2)
    t.apply(B, [stored(CONTEXT, [1, 2, 3, 4, 5, 6])], 0.0)
    loaded = load_table(dump_table(t, 7, "7-0"), HASHER).table
    assert loaded.held_roots(None, 0.0) == t.held_roots(None, 0.0) == {A: 0, B: 1}


def test_a_snapshot_from_before_markers_loads_each_root_as_its_own_marker() -> None:
    """A snapshot with roots but no ``markers`` (written before them) loads: its roots count by
    their first block, as then, until a routed prompt of the root sets a marker."""
    t = homed_then_evicted_from(keep=6)  # A holds the whole context
    data = dump_table(t, 7, "7-0")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    header = msgpack.unpackb(data[len(MAGIC) + 4 : len(MAGIC) + 4 + size], raw=False)
    assert header.pop("markers") == 1
    packed = msgpack.packb(header, use_bin_type=True)
    old = MAGIC + len(packed).to_bytes(4, "little") + packed + data[len(MAGIC) + 4 + size : -8]
    loaded = load_table(old, HASHER).table
    loaded.apply(A, [Removed(0, tuple(EngineHash(h) for h in (6, 5, 4, 3)))], 0.0)
    assert loaded.held_roots(None, 0.0) == {A: 1}  # its marker is its root, which A holds
    loaded.add_speculative(B, HASHER.request_keys(CONTEXT), 5.0, 0.0)
    assert loaded.held_roots(None, 1.0) == {A: 0, B: 1}
