"""``PrefixTable`` behaviour beyond the shared contract: bounds, slots, caches and edge cases."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import replace

import pytest
from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.events import Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.slots import TableLimits
from balancer.index.table import TOUCH_LOG_KEYS, PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 2
HASHER = BlockHasher("m", BS)
A, B, C = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")


def toks(blocks: int, first: int = 1) -> list[int]:
    return list(range(first, first + blocks * BS))


def stored(
    tokens: Sequence[int],
    engine: Sequence[int],
    parent: int | None = None,
    dp_rank: int = 0,
    lora_name: str | None = None,
) -> Stored:
    return Stored(
        dp_rank,
        None if parent is None else EngineHash(parent),
        tuple(EngineHash(h) for h in engine),
        pack_tokens(tokens),
        BS,
        lora_name=lora_name,
    )


def table(**limits: int) -> PrefixTable:
    return PrefixTable(HASHER, TableLimits(**limits))


def blocks(
    t: PrefixTable, tokens: Sequence[int], among: Sequence[ReplicaId] | None = None, now: float = 0.0
) -> dict[ReplicaId, int]:
    return t.match(HASHER.request_keys(tokens), among, now).blocks


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError):
        TableLimits(capacity_blocks=0)
    with pytest.raises(ValueError):
        TableLimits(max_speculative_keys=-1)


def test_eviction_is_batched_above_128_blocks() -> None:
    t = table(capacity_blocks=1280)
    evicted = 0
    for i in range(130):
        first = 1 + i * 10 * BS
        evicted += t.apply(A, [stored(toks(10, first), range(i * 10, i * 10 + 10))], 0.0).evicted_blocks
    # the 129th chain makes 1290 > 1280: evict down to 1280 - 1280 // 128 = 1270; the 130th fits
    assert evicted == 20
    assert t.stats().unique_blocks == 1280
    assert t.counters.evicted_blocks == 20
    assert blocks(t, toks(10, 1)) == {A: 0}  # the oldest chain went first
    assert blocks(t, toks(10, 1 + 129 * 10 * BS)) == {A: 10}


def test_a_child_of_an_evicted_parent_still_chains() -> None:
    t = table(capacity_blocks=2)
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    t.apply(B, [stored(toks(2, 100), [7, 8])], 0.0)  # evicts A's two blocks
    assert blocks(t, toks(2)) == {A: 0, B: 0}
    result = t.apply(A, [stored(toks(1, 50), [3], parent=2)], 0.0)
    assert result.skipped_unknown_parent == 0 and result.stored_blocks == 1
    keys = HASHER.request_keys(toks(2) + toks(1, 50))
    assert t.match(keys, [A], 0.0).blocks == {A: 0}  # its ancestors are gone from the index...
    assert t.stats().blocks_by_replica[A] == 1  # ...but the child is held under the right key
    assert keys[-1] in t._holders


def test_stale_engine_hashes_are_compacted() -> None:
    t = table(capacity_blocks=16)
    for i in range(200):  # replica A stores 200 * 4 blocks; B's stores evict most of them
        t.apply(A, [stored(toks(4, 1 + i * 8 * BS), range(i * 4, i * 4 + 4))], 0.0)
        t.apply(B, [stored(toks(4, 5000 + i * 8 * BS), range(i * 4, i * 4 + 4))], 0.0)
    cache = t._slots.cache(A, 0)
    assert cache is not None
    assert cache.held <= 16
    assert len(cache.keys) <= 2 * cache.held + 64 + 4


def test_a_second_handle_for_the_same_tokens() -> None:
    t = table()
    t.apply(A, [stored(toks(1), [1]), stored(toks(1), [2])], 0.0)
    assert t.stats().held_blocks == 1
    t.apply(A, [Removed(0, (EngineHash(1),))], 0.0)
    assert blocks(t, toks(1)) == {A: 1}
    t.apply(A, [Removed(0, (EngineHash(2),))], 0.0)
    assert blocks(t, toks(1)) == {A: 0}
    assert t.stats().unique_blocks == 0


def test_a_reused_handle_releases_its_old_tokens() -> None:
    t = table()
    t.apply(A, [stored(toks(1), [1])], 0.0)
    t.apply(A, [stored(toks(1, 40), [1])], 0.0)
    assert blocks(t, toks(1)) == {A: 0}
    assert blocks(t, toks(1, 40)) == {A: 1}
    assert t.stats().held_blocks == 1


def test_speculative_keys_are_capped_and_counted() -> None:
    t = table(max_speculative_keys=3)
    t.add_speculative(A, HASHER.request_keys(toks(5)), 10.0, 0.0)
    assert t.stats().speculative_entries == 3
    assert t.counters.speculative_overflow == 2
    assert blocks(t, toks(5)) == {A: 3}
    t.add_speculative(B, HASHER.request_keys(toks(1, 90)), 10.0, 0.0)
    assert t.counters.speculative_overflow == 3
    off = table(max_speculative_keys=0)
    off.add_speculative(A, HASHER.request_keys(toks(2)), 10.0, 0.0)
    assert off.counters.speculative_overflow == 2 and blocks(off, toks(2)) == {}


def test_speculation_is_a_chain_of_its_own() -> None:
    t = table()
    t.apply(A, [stored(toks(2), [1, 2], dp_rank=1)], 0.0)
    t.add_speculative(A, HASHER.request_keys(toks(3))[2:], 1.0, 0.0)
    assert blocks(t, toks(3)) == {A: 2}  # a tail alone does not extend another rank's prefix
    t.add_speculative(A, HASHER.request_keys(toks(3)), 1.0, 0.0)
    assert t.stats().speculative_entries == 3
    result = t.match(HASHER.request_keys(toks(3)), None, 0.0)
    assert (result.blocks, result.best_rank) == ({A: 3}, {A: 0})
    t.apply(A, [stored(toks(3), [1, 2, 3], dp_rank=1)], 0.5)  # confirms all three
    assert t.stats().speculative_entries == 3  # held to their expiry, now beside the real holding
    assert t.counters.speculative_confirmed == 3
    result = t.match(HASHER.request_keys(toks(3)), None, 0.6)
    assert (result.blocks, result.best_rank) == ({A: 3}, {A: 1})  # the real holding's rank
    result = t.match(HASHER.request_keys(toks(3)), None, 1.0)
    assert (result.blocks, result.best_rank) == ({A: 3}, {A: 1})
    assert t.stats().speculative_entries == 0 and t.counters.speculative_expired == 3


def test_expiry_also_runs_on_apply_and_counts() -> None:
    t = table()
    t.add_speculative(A, HASHER.request_keys(toks(2)), 1.0, 0.0)
    t.apply(B, [], 5.0)
    assert t.stats().speculative_entries == 0
    assert t.stats().unique_blocks == 0
    assert t.counters.speculative_expired == 2


def test_expiry_counts_a_key_listed_twice_once() -> None:
    """A heap entry listing a key twice: the key is popped and counted once (the pops' count is the
    expiry dict's shrinkage, not the listing's length)."""
    t = table()
    keys = tuple(HASHER.request_keys(toks(3)))
    t.add_speculative(A, (*keys, keys[1]), 1.0, 0.0)
    t.add_speculative(B, keys[:2], 3.0, 0.0)
    t.apply(C, [], 2.0)  # A's entry is due, B's not yet
    assert t.counters.speculative_expired == 3
    assert t.stats().speculative_entries == 2
    held = blocks(t, toks(3), now=2.0)
    assert (held[B], held.get(A, 0)) == (2, 0)
    t.apply(C, [], 4.0)
    assert t.counters.speculative_expired == 5
    assert t.stats().speculative_entries == 0 and t.stats().unique_blocks == 0


def test_a_replayed_store_then_clear_leaves_a_routed_requests_entry() -> None:
    """The fresh-kvlb replay (docs/loadtest-history.md, 2026-11-29, items 5-6): a request is routed to A
    (speculative entries), A's replayed history then stores the same blocks and clears them. The
    follower still finds the 3 blocks until the request's entries expire; the reported overlap
    counts the confirmed keys while the real copy lasts."""
    t = table()
    keys = tuple(HASHER.request_keys(toks(4)))
    t.add_speculative(A, keys[:3], 30.0, 0.0)
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.1)
    overlap, confirmed = t.match_confirmed(keys, None, 0.2)
    assert (overlap.blocks, confirmed) == ({A: 3}, {A: 3})  # both held: reported, not speculative
    assert t.counters.speculative_confirmed == 3 and t.stats().speculative_entries == 3
    assert t.speculated(A, keys, 0.2) == []  # stored since the routing
    assert t.speculated(A, keys, 0.2, since=0.1) == []  # ... at 0.1
    assert t.speculated(A, keys, 0.2, since=0.15) == list(keys[:3])  # not since a routing at 0.15
    t.apply(A, [Resync(0, "restart")], 0.3)  # the replayed clear
    overlap, confirmed = t.match_confirmed(keys, None, 0.4)
    assert (overlap.blocks, confirmed) == ({A: 3}, {})
    assert t.held_roots(None, 0.4) == {A: 1}
    assert t.speculated(A, keys, 0.4) == []  # still noted as stored (the receipts' guard)
    assert blocks(t, toks(4), now=30.0) == {A: 0}
    assert t.stats().speculative_entries == 0 and t.counters.speculative_expired == 3
    assert not t._slots.specs[A].stored  # noted only while pending


def test_a_gap_holds_drop_leaves_a_confirmed_speculative_entry() -> None:
    """After an event gap the real holding is suspect and dropped unconfirmed at the hold's end; the
    request's speculative entry, confirmed before the gap, stays to its own expiry."""
    t = PrefixTable(HASHER, TableLimits(gap_hold_s=0.5))
    keys = tuple(HASHER.request_keys(toks(3)))
    t.add_speculative(A, keys, 5.0, 0.0)
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.1)
    t.apply(A, [Resync(0, "gap")], 0.2)
    assert t.suspect_blocks(A) == 3
    overlap, confirmed = t.match_confirmed(keys, None, 1.0)  # the hold ended at 0.7: dropped
    assert (overlap.blocks, confirmed, t.held_blocks(A)) == ({A: 3}, {}, 0)
    assert t.counters.suspect_dropped == 3
    assert blocks(t, toks(3), now=5.0) == {A: 0}


def test_a_store_keeps_the_deferred_expiry_log_and_the_held_prefix() -> None:
    """A store confirms without removing a pending key: the slot's logged re-adds and the prefix a
    match noted stay valid (a later re-add still only logs), and every key gets its newest expiry."""
    t = table()
    keys = tuple(HASHER.request_keys(toks(3)))
    t.add_speculative(A, keys, 30.0, 0.0)
    t.add_speculative(A, keys, 2.0, 0.5)  # the first token: logged
    spec = t._slots.specs[A]
    assert spec.deferred and spec.held
    t.apply(A, [stored(toks(3), [1, 2, 3])], 0.6)
    assert spec.deferred and spec.held  # untouched by the store
    assert blocks(t, toks(3), now=2.4) == {A: 3}
    t.apply(A, [Removed(0, (EngineHash(1),))], 2.4)
    assert blocks(t, toks(3), now=2.45) == {A: 3}
    assert blocks(t, toks(3), now=2.5) == {A: 0}  # the newest expiry (0.5 + 2.0), not 30


def test_a_confirmed_key_leaves_the_stored_notes_when_evicted() -> None:
    t = table(capacity_blocks=3)
    t.add_speculative(A, HASHER.request_keys(toks(2)), 10.0, 0.0)
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    assert len(t._slots.specs[A].stored) == 2
    t.apply(B, [stored(toks(2, 30), [5, 6])], 0.0)  # over the budget: the oldest go, all holders
    spec = t._slots.specs[A]
    assert t.counters.evicted_blocks == 1 and t.stats().speculative_entries == 1
    assert list(spec.stored) == list(spec.pending) == [HASHER.request_keys(toks(2))[1]]


def test_evicting_a_speculative_key_forgets_it() -> None:
    t = table(capacity_blocks=2)
    t.add_speculative(A, HASHER.request_keys(toks(2)), 10.0, 0.0)
    t.apply(B, [stored(toks(2, 30), [1, 2])], 0.0)
    assert t.stats().speculative_entries == 0
    assert blocks(t, toks(2), now=20.0) == {A: 0, B: 0}


def test_slots_are_bounded_and_reused() -> None:
    t = table(max_slots=2)
    t.apply(A, [stored(toks(1), [1])], 0.0)
    t.apply(B, [stored(toks(1), [1])], 0.0)
    assert t.apply(C, [stored(toks(1), [1])], 0.0).stored_blocks == 0
    assert t.counters.slot_overflow == 1
    t.add_speculative(C, HASHER.request_keys(toks(1)), 1.0, 0.0)
    assert t.counters.slot_overflow == 2 and t.counters.speculative_overflow == 1
    assert t.drop_replica(A) == 1
    assert t.apply(C, [stored(toks(2), [1, 2])], 0.0).stored_blocks == 2
    assert blocks(t, toks(2)) == {B: 1, C: 2}


def test_a_reused_speculative_slot_ignores_old_expiries() -> None:
    t = table(max_slots=1)
    t.add_speculative(A, HASHER.request_keys(toks(2)), 1.0, 0.0)
    t.drop_replica(A)
    t.add_speculative(B, HASHER.request_keys(toks(2)), 5.0, 0.0)
    assert blocks(t, toks(2), now=2.0) == {B: 2}  # A's heap entry at t=1 must not expire B's keys
    assert blocks(t, toks(2), now=5.0) == {B: 0}


def test_cached_candidate_masks_follow_new_replicas() -> None:
    t = table()
    among = frozenset({A, B})
    t.apply(A, [stored(toks(2), [1, 2])], 0.0)
    assert blocks(t, toks(2), among=among) == {A: 2, B: 0}  # type: ignore[arg-type]
    t.apply(B, [stored(toks(1), [1])], 0.0)
    assert blocks(t, toks(2), among=among) == {A: 2, B: 1}  # type: ignore[arg-type]
    t.drop_replica(A)
    t.apply(C, [stored(toks(2), [1, 2])], 0.0)  # takes A's old slot
    assert blocks(t, toks(2), among=among) == {A: 0, B: 1}  # type: ignore[arg-type]
    assert blocks(t, toks(2)) == {B: 1, C: 2}


def test_short_or_malformed_events() -> None:
    t = table()
    short = Stored(0, None, (EngineHash(1), EngineHash(2)), pack_tokens(toks(1)), BS)
    assert t.apply(A, [short], 0.0).skipped_block_size_mismatch == 1
    empty = Stored(0, None, (), b"", BS)
    assert t.apply(A, [empty], 0.0).stored_blocks == 0
    assert t.apply(A, [Removed(0, (EngineHash(5),))], 0.0).unknown_removals == 1
    assert t.stats().unique_blocks == 0 and t.stats().bytes_per_block is None


def test_memory_estimate_is_plausible() -> None:
    t = table()
    for i in range(100):
        t.apply(A, [stored(toks(10, 1 + i * 20 * BS), range(i * 10, i * 10 + 10))], 0.0)
    estimate = t.stats().bytes_per_block
    assert estimate is not None and 72 < estimate < 400


def test_confirmed_only_ignores_speculative_holdings() -> None:
    t = table()
    keys = HASHER.request_keys(toks(3))
    t.apply(A, [stored(toks(1), [1])], 0.0)
    assert not t.has_speculative
    t.add_speculative(A, keys, 1.0, 0.0)
    t.add_speculative(B, keys, 1.0, 0.0)
    assert t.has_speculative
    assert t.match(keys, None, 0.0).blocks == {A: 3, B: 3}
    assert t.match(keys, None, 0.0, confirmed_only=True).blocks == {A: 1, B: 0}
    assert t.match(keys, frozenset({B}), 0.0, confirmed_only=True).blocks == {B: 0}
    t.drop_replica(B)
    assert t.match(keys, None, 0.5).blocks == {A: 3}


@pytest.mark.parametrize("mode", ["plain", "trtllm", "bigram"])
def test_prefix_holders_agree_with_match(mode: str) -> None:
    import random

    hasher = BlockHasher("m", BS, mode)  # type: ignore[arg-type]
    rng = random.Random(7)
    t = PrefixTable(hasher, TableLimits())
    prefixes = [[rng.randrange(1, 9) for _ in range(12)] for _ in range(4)]
    for n, replica in enumerate([A, B, C, ReplicaId("d")]):
        for k, prefix in enumerate(rng.sample(prefixes, 2)):
            depth = rng.randrange(1, 5)
            chain = stored(
                prefix[: depth * BS + hasher.lookahead_tokens],
                range(100 * n + 10 * k, 100 * n + 10 * k + depth),
            )
            t.apply(
                replica,
                [Stored(0, None, chain.engine_hashes, chain.tokens, BS, hasher.lookahead_tokens)],
                0.0,
            )
    t.add_speculative(C, hasher.request_keys(prefixes[0][:9]), 1.0, 0.0)
    for now in (0.5, 2.0):  # the speculative entry alive, then expired
        for _ in range(200):
            tokens = rng.choice(prefixes)[: rng.randrange(0, 13)] + [rng.randrange(1, 9) for _ in range(2)]
            keys = hasher.request_keys(tokens)
            first = t.match(keys[:1], None, now).blocks
            overlap = t.match(keys, None, now).blocks
            holders = t.prefix_holders(tokens, now)
            assert set(holders) == {r for r, b in first.items() if b}
            assert set(holders) == {r for r, b in overlap.items() if b}


def test_re_added_keys_do_not_pile_up_in_the_expiry_heap() -> None:
    """The router's pattern: each request's keys are added with the long first-byte TTL, then again
    with the short TTL at its first token. The long entries stay listed until their own expiry; the
    heap is rebuilt whenever it would list more than 2 × the cap (defect 8: a minute of requests'
    keys kept alive). Expiry still follows the latest TTL of each key."""
    t = table(max_speculative_keys=1000)
    now = 0.0
    for request in range(400):  # 400 × 20 keys listed twice (the long entries for 60 s): 16 000
        keys = HASHER.request_keys(toks(20, first=1000 * request))
        t.add_speculative(A, keys, 60.0, now)
        t.add_speculative(A, keys, 2.0, now)
        assert t.speculative_listed <= 2 * 1000
        now += 0.1  # 20 requests (400 keys) within the short TTL: under the cap of 1000
    assert t.counters.speculative_compactions > 0
    assert t.stats().speculative_entries <= 1000
    live = HASHER.request_keys(toks(20, first=1000 * 399))
    assert t.match(live, None, now).blocks == {A: 20}
    assert t.match(live, None, now + 3.0).blocks.get(A, 0) == 0  # the short TTL, not the long one
    assert t.stats().speculative_entries == 0


@settings(max_examples=80, deadline=None)
@given(
    holdings=st.lists(
        st.tuples(st.sampled_from([A, B, C]), st.integers(0, 1), st.integers(1, 8), st.booleans()),
        max_size=12,
    ),
    query=st.integers(0, 10),
    among=st.none() | st.lists(st.sampled_from([A, B, C]), unique=True).map(tuple),
)
def test_one_walk_gives_both_matches(
    holdings: list[tuple[ReplicaId, int, int, bool]], query: int, among: tuple[ReplicaId, ...] | None
) -> None:
    """``match_confirmed`` (one walk) agrees with ``match`` with and without ``confirmed_only``, over
    caches of several ranks holding prefixes of one prompt, with gaps, and speculative holdings."""
    t = table()
    prompt = toks(10)
    keys = HASHER.request_keys(prompt)
    for replica, rank, length, speculative in holdings:
        if speculative:
            t.add_speculative(replica, keys[:length], 10.0, 0.0)
        else:  # blocks [0, length) by this rank, except one gap when the length is even
            engine = [hash((replica, rank, i)) & 0xFFFF for i in range(length)]
            t.apply(replica, [stored(prompt[: 2 * length], engine, dp_rank=rank)], 0.0)
            if length % 2 == 0:
                t.apply(replica, [Removed(rank, (EngineHash(engine[length // 2]),))], 0.0)
    query_keys = HASHER.request_keys(prompt[: 2 * query])
    overlap, confirmed = t.match_confirmed(query_keys, among, 1.0)
    assert overlap == t.match(query_keys, among, 1.0)
    reported = t.match(query_keys, among, 1.0, confirmed_only=True).blocks
    assert confirmed == {replica: n for replica, n in reported.items() if n}


def test_speculative_adds_extend_refuse_and_expire() -> None:
    """The bulk paths of ``add_speculative`` and ``_expire``: re-adding extends, new keys beyond the
    cap are refused (and the rest of the prompt still taken), due keys lose their bit."""
    t = table(max_speculative_keys=6)
    first, second = HASHER.request_keys(toks(4)), HASHER.request_keys(toks(4, 100))
    t.add_speculative(A, first, 1.0, 0.0)
    t.add_speculative(A, [*first, *second], 5.0, 0.0)  # 4 extended, 2 of 4 new taken
    assert t.stats().speculative_entries == 6 and t.counters.speculative_overflow == 2
    assert blocks(t, toks(4), now=2.0) == {A: 4}  # extended past the first expiry
    assert blocks(t, toks(4, 100), now=2.0) == {A: 2}
    assert blocks(t, toks(4), now=6.0) == {A: 0} and t.stats().speculative_entries == 0


def _reinserted(holders: dict[int, int], chain: tuple[int, ...]) -> list[tuple[int, int]]:
    """The items of ``holders`` after the LRU re-insert of ``chain`` that ``add_speculative`` does."""
    out = dict(holders)
    masks = [out.pop(key, 0) for key in chain]
    out.update(zip(reversed(chain), reversed(masks), strict=True))
    return list(out.items())


_PROMPTS = (toks(6), toks(6, 100), [*toks(3), *toks(3, 200)])
_CHAINS = tuple(HASHER.request_keys(p) for p in _PROMPTS)
_OPS = st.one_of(
    st.tuples(  # a routed request: a prefix of one prompt's keys, maybe with a repeated key
        st.just("add"),
        st.sampled_from((A, B)),
        st.integers(0, len(_CHAINS) - 1),
        st.integers(0, 6),
        st.booleans(),
        st.sampled_from((0.5, 3.0)),
    ),
    st.tuples(
        st.just("store"), st.sampled_from((A, B)), st.integers(0, len(_PROMPTS) - 1), st.integers(1, 6)
    ),
    st.tuples(st.just("remove"), st.sampled_from((A, B)), st.integers(0, 30)),
    st.tuples(st.just("gap"), st.sampled_from((A, B))),
    st.tuples(st.just("drop"), st.sampled_from((A, B))),
    st.tuples(st.just("tick"), st.sampled_from((0.25, 1.0))),
)


def _engine(prompt: int, i: int) -> int:
    return prompt * 10 + i


def _run(t: PrefixTable, op: tuple[object, ...], now: float) -> object:
    kind = op[0]
    if kind == "add":
        _, replica, chain, depth, repeat_key, ttl = op
        keys = list(_CHAINS[chain][: int(depth)])  # type: ignore[call-overload]
        if repeat_key and keys:
            keys.append(keys[0])
        t.add_speculative(replica, keys, ttl, now)  # type: ignore[arg-type]
        return None
    if kind == "store":
        _, replica, prompt, count = op
        engine = [_engine(prompt, i) for i in range(count)]  # type: ignore[call-overload]
        return t.apply(replica, [stored(_PROMPTS[prompt][: count * BS], engine)], now)  # type: ignore[arg-type, index, operator]
    if kind == "remove":
        return t.apply(op[1], [Removed(0, (EngineHash(op[2]),))], now)  # type: ignore[arg-type]
    if kind == "gap":
        return t.apply(op[1], [Resync(0, "gap")], now)  # type: ignore[arg-type]
    if kind == "drop":
        return t.drop_replica(op[1])  # type: ignore[arg-type]
    return None


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(_OPS, max_size=40), st.sampled_from((6, 10, 64)))
def test_deferred_lru_reinserts_match_reinserting_at_each_add(
    ops: list[tuple[object, ...]], capacity: int
) -> None:
    """The logged re-inserts of ``add_speculative`` (applied when the order is next needed) leave the
    same table as re-inserting each routed chain at once, which the reference table does: reading
    its ``_holders`` after every operation settles the log every time (one chain: the old re-insert,
    ``test_repeated_speculative_add_keeps_the_lru_order_of_a_full_reinsert``). Stores, removals,
    event gaps (suspects read the order), expiry, eviction and dropped replicas in between."""
    limits = TableLimits(capacity_blocks=capacity, gap_hold_s=0.5, gap_keep_s=2.0, max_speculative_keys=12)
    lazy, eager = PrefixTable(HASHER, limits), PrefixTable(HASHER, limits)
    now = 0.0
    for op in ops:
        if op[0] == "tick":
            now += float(op[1])  # type: ignore[arg-type]
            continue
        assert _run(lazy, op, now) == _run(eager, op, now)
        list(eager._holders)  # settles: every chain re-inserted at its own add
        for prompt in _PROMPTS:
            keys = HASHER.request_keys(prompt)
            assert lazy.match_confirmed(keys, None, now) == eager.match_confirmed(keys, None, now)
    assert list(lazy._holders.items()) == list(eager._holders.items())
    # the dicts' sizes may differ (their resize histories do), not their contents
    assert replace(lazy.stats(), bytes_per_block=None) == replace(eager.stats(), bytes_per_block=None)
    assert lazy.counters == eager.counters
    for replica in (A, B):
        for rank in lazy._slots.caches.get(replica, {}):
            cache, other = lazy._slots.caches[replica][rank], eager._slots.caches[replica][rank]
            assert list(cache.suspect) == list(other.suspect)


def test_deferred_reinserts_are_bounded() -> None:
    """The log of chains waiting for their re-insert is applied once it lists ``TOUCH_LOG_KEYS`` keys."""
    t = PrefixTable(HASHER, TableLimits(gap_hold_s=0.5, gap_keep_s=2.0))
    keys = HASHER.request_keys(toks(64))
    for i in range(TOUCH_LOG_KEYS // len(keys) + 2):
        t.add_speculative(A, keys, 5.0, float(i) * 1e-3)
        assert t._touched_keys <= TOUCH_LOG_KEYS
    assert t._touched_keys < 2 * len(keys)


def test_repeated_speculative_add_keeps_the_lru_order_of_a_full_reinsert() -> None:
    t = PrefixTable(HASHER, TableLimits(gap_hold_s=1.0, gap_keep_s=2.0))
    assert t.limits.lru_frontier
    first, second = HASHER.request_keys(list(range(8))), HASHER.request_keys(list(range(100, 106)))
    for now, keys in enumerate((first, second, first, first, second, second, first)):
        expected = _reinserted(dict(t._holders), tuple(keys))
        t.add_speculative(A, keys, 5.0, float(now))
        assert [key for key, _ in expected] == list(t._holders)


def _naive_walk(holders: dict[int, int], keys: Sequence[int], mask: int) -> list[tuple[int, int]]:
    """Each slot of ``mask``'s count of leading ``keys`` it holds, grouped by count (> 0)."""
    by_depth: dict[int, int] = {}
    for slot in range(mask.bit_length()):
        bit = 1 << slot
        if not mask & bit:
            continue
        depth = 0
        while depth < len(keys) and holders.get(keys[depth], 0) & bit:
            depth += 1
        if depth:
            by_depth[depth] = by_depth.get(depth, 0) | bit
    return sorted(by_depth.items())


@settings(max_examples=examples(500), deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 9), st.integers(1, 2**9 - 1) | st.sampled_from((1, 3, 2**70 + 1)), max_size=10
    ),
    st.lists(st.integers(0, 9), max_size=12),
    st.integers(0, 2**9 - 1) | st.just(2**70 + 3),
)
def test_walk_matches_a_slot_by_slot_scan(holders: dict[int, int], keys: list[int], mask: int) -> None:
    """``_walk`` (C-speed runs, and its shortcut when every key up to the first missing one has the
    same holders) gives each slot's count of leading keys held, as a scan slot by slot does; missing
    keys end the prefix."""
    t = table()
    t._holders = holders
    assert t._walk(keys, mask) == _naive_walk(holders, keys, mask)
    same = {key: holders.get(keys[0], 1) if keys else 1 for key in keys}  # the shortcut's case
    t._holders = same
    assert t._walk(keys, mask) == _naive_walk(same, keys, mask)
    # a held prefix, a missing key, held keys, a missing last key: where halving stops may not be
    # the first missing key (the read by ``itemgetter`` then falls back to ``get``)
    for cut in range(len(keys)):
        for later in range(cut + 1, len(keys) + 1):
            held = {key: same[key] for key in keys[:cut]} | {key: same[key] for key in keys[later:-1]}
            held = {key: mask for key, mask in held.items() if key not in keys[cut:later] + keys[-1:]}
            t._holders = held
            assert t._walk(keys, mask) == _naive_walk(held, keys, mask)
    # a key missing before a held last key: the masks read by ``itemgetter`` fall back to ``get``
    gap = {key: value for key, value in same.items() if key != keys[len(keys) // 2]} if keys else {}
    t._holders = gap
    assert t._walk(keys, mask) == _naive_walk(gap, keys, mask)
    # the shortcut after the first missing key: a shared prefix, then a new prompt's tail
    prefix = {key: same[key] for key in keys[: len(keys) // 2]}
    tail = [key + 100 for key in keys[len(keys) // 2 :]]
    t._holders = prefix
    assert t._walk([*keys[: len(keys) // 2], *tail], mask) == _naive_walk(
        prefix, [*keys[: len(keys) // 2], *tail], mask
    )


class _ScanningTable(PrefixTable):
    """The reference for ``add_speculative``'s new keys: the scan it made before it found them from
    ``pending``'s size (each key looked up, then the expiries written), kept as it was (apart from
    passing a listed root's mask change on to the held-roots counts, as every writer of a mask must);
    and for ``_expire``, its filter of every entry's keys, without the count that skips most entries."""

    def _expire(self, now: float) -> None:
        heap = self._spec_heap
        while heap and heap[0][0] <= now:
            expiry_s, _, spec, keys = heapq.heappop(heap)
            self._spec_refs -= len(keys)
            if not spec.alive:
                continue
            pending = spec.expiry
            due = [key for key in keys if pending.get(key) == expiry_s]
            expired = len(due) - sum(pending.pop(key, None) is None for key in due)
            self._spec_count -= expired
            self.counters.speculative_expired += expired
            self._unset(due, spec.bit)

    def add_speculative(self, replica: ReplicaId, keys: Sequence[int], ttl_s: float, now: float) -> None:
        if self._spec_heap and self._spec_heap[0][0] <= now:
            self._expire(now)
        if ttl_s <= 0 or not keys:
            return
        limit = self.limits.max_speculative_keys
        spec = self._slots.specs.get(replica)
        if spec is None and limit:
            spec = self._slots.new_spec(replica)
        if spec is None:
            self.counters.speculative_overflow += len(keys)
            return
        if self._spec_refs + min(len(keys), limit) > 2 * limit:
            self._compact_spec_heap()
        expiry_s = now + ttl_s
        pending = spec.expiry
        taken = tuple(keys)
        fresh = [key for key in dict.fromkeys(taken) if key not in pending]
        if fresh:
            room = max(0, limit - self._spec_count)
            if len(fresh) > room:
                self.counters.speculative_overflow += len(fresh) - room
                refused = set(fresh[room:])
                fresh = fresh[:room]
                taken = tuple(key for key in taken if key not in refused)
            self._spec_count += len(fresh)
            take = self._masks.get if self.limits.lru_frontier else self._masks.pop
            for key in fresh:
                mask = take(key, 0)
                self._masks[key] = mask | spec.bit
                if key in self._roots.listed:  # as the table passes a listed root's change on
                    self._roots.moved(mask, mask | spec.bit, self._slots)
        if self.limits.lru_frontier:
            if taken:
                self._log_touch(taken)
            if self._suspects:
                self._touch_suspects(replica, taken)
        pending.update((key, expiry_s) for key in taken)
        if taken:
            self._spec_seq += 1
            self._spec_refs += len(taken)
            heapq.heappush(self._spec_heap, (expiry_s, self._spec_seq, spec, taken))
        if len(self._masks) > self.limits.capacity_blocks:
            self._evict()


@settings(max_examples=examples(400), deadline=None)
@given(
    st.lists(_OPS, max_size=40),
    st.sampled_from((6, 10, 64)),
    st.sampled_from((0, 3, 12, 1000)),
    st.booleans(),
)
def test_speculative_adds_match_scanning_for_new_keys(
    ops: list[tuple[object, ...]], capacity: int, cap: int, frontier: bool
) -> None:
    """``add_speculative`` takes a chain's new keys from the end of the replica's expiry dict, and
    refuses those past ``max_speculative_keys`` by deleting them again; ``_expire`` skips an entry
    none of whose keys is due: the table, each replica's expiries (and their order), the expiry heap
    and the counters end as with the scan and the filter they replaced, over routed chains with
    repeated keys, overflow, stores that confirm, expiry, eviction, gaps and dropped replicas."""
    gap = {"gap_hold_s": 0.5, "gap_keep_s": 2.0} if frontier else {}
    limits = TableLimits(capacity_blocks=capacity, max_speculative_keys=cap, **gap)  # type: ignore[arg-type]
    fast, scanning = PrefixTable(HASHER, limits), _ScanningTable(HASHER, limits)
    now = 0.0
    for op in ops:
        if op[0] == "tick":
            now += float(op[1])  # type: ignore[arg-type]
            continue
        assert _run(fast, op, now) == _run(scanning, op, now)
        for prompt in _PROMPTS:
            keys = HASHER.request_keys(prompt)
            assert fast.match_confirmed(keys, None, now) == scanning.match_confirmed(keys, None, now)
    assert list(fast._holders.items()) == list(scanning._holders.items())
    assert fast.counters == scanning.counters
    assert fast.stats().speculative_entries == scanning.stats().speculative_entries
    for replica in (A, B):
        spec, other = fast._slots.specs.get(replica), scanning._slots.specs.get(replica)
        assert (spec is None) == (other is None)
        if spec is not None and other is not None:
            assert list(spec.expiry.items()) == list(other.expiry.items())
    assert [(e, keys) for e, _, _, keys in sorted(fast._spec_heap)] == [
        (e, keys) for e, _, _, keys in sorted(scanning._spec_heap)
    ]
