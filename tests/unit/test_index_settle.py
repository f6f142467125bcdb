"""The prefix table's deferred LRU re-inserts and expiry-heap compaction, against plain references.

``first_uses`` skips a routed chain's leading run of keys that an earlier chain already listed
(found by a binary search, proven by comparing the run with that chain); ``group_by_value`` groups a
replica's speculative expiries run by run; ``_log_touch`` lists a tuple re-added by the same request
once. Each must give exactly what the per-key form gives, for chains and for arbitrary sequences.
"""

from __future__ import annotations

import random
from itertools import chain

from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.index.hashing import BlockHasher
from balancer.index.settle import first_uses, group_by_value
from balancer.index.slots import TableLimits
from balancer.index.table import PrefixTable
from balancer.types import ReplicaId

HASHER = BlockHasher("m", 2)
A, B = ReplicaId("a"), ReplicaId("b")

_PROMPTS = st.lists(st.integers(0, 2), min_size=0, max_size=14)
"""Token ids over a tiny alphabet: prompts share prefixes (and so chains share leading keys)."""


def _chains(prompts: list[list[int]], cuts: list[int]) -> list[tuple[int, ...]]:
    """Each prompt's block keys, some cut to a prefix (a receipt's found keys)."""
    out = []
    for prompt, cut in zip(prompts, cuts, strict=False):
        keys = tuple(HASHER.request_keys(prompt))
        out.append(keys[:cut] if cut < len(keys) else keys)
    return out


@settings(max_examples=400, deadline=None)
@given(
    st.lists(_PROMPTS, max_size=10),
    st.lists(st.integers(0, 8), min_size=10, max_size=10),
    st.lists(st.lists(st.integers(0, 9), max_size=8), max_size=4),
    st.randoms(use_true_random=False),
)
def test_first_uses_lists_what_fromkeys_lists(
    prompts: list[list[int]], cuts: list[int], others: list[list[int]], rng: random.Random
) -> None:
    """Chains with shared prefixes, prefixes of chains, and sequences that are no chains (a key
    repeated, at other depths, out of order) in any mix: the same keys in the same order as
    ``dict.fromkeys`` of their concatenation, each mapped to the first sequence that lists it."""
    sequences = [*_chains(prompts, cuts), *(tuple(seq) for seq in others)]
    rng.shuffle(sequences)
    found = first_uses(sequences)
    assert list(found) == list(dict.fromkeys(chain.from_iterable(sequences)))
    first: dict[int, tuple[int, ...]] = {}
    for seq in sequences:
        for key in seq:
            first.setdefault(key, seq)
    assert all(listed is first[key] for key, listed in found.items())


def test_first_uses_does_not_trust_a_run_it_cannot_prove() -> None:
    """A key repeated at the end makes the leading run look listed (its first and last keys are);
    the comparison with the earlier sequence fails, so every key is looked up."""
    assert list(first_uses([(1,), (1, 2, 3, 1)])) == [1, 2, 3]
    assert list(first_uses([(5, 1), (1, 2, 3)])) == [5, 1, 2, 3]
    assert list(first_uses([(1, 2, 9), (1, 2, 3, 4), (1, 2, 3, 4, 5)])) == [1, 2, 9, 3, 4, 5]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 50), st.sampled_from((1.0, 2.0, 2.5, 0.0, -0.0)), max_size=30))
def test_by_value_groups_like_a_loop_over_the_keys(expiry: dict[int, float]) -> None:
    reference: dict[float, list[int]] = {}
    for key, value in expiry.items():
        reference.setdefault(value, []).append(key)
    assert list(group_by_value(expiry).items()) == list(reference.items())


_ADDS = st.lists(
    st.tuples(st.sampled_from((A, B)), st.integers(0, 5), st.sampled_from((0.5, 3.0)), st.booleans()),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_PROMPTS, min_size=6, max_size=6), _ADDS, st.sampled_from((6, 64)))
def test_a_tuple_logged_again_moves_like_a_new_listing(
    prompts: list[list[int]], adds: list[tuple[ReplicaId, int, float, bool]], capacity: int
) -> None:
    """Requests' tuples added again (a first token), others in between, time passing: the table
    whose log lists each tuple once ends as one settled after every add, and the log counts a
    tuple's keys once however often it is added again."""
    tuples = [tuple(HASHER.request_keys(prompt)) for prompt in prompts]
    limits = TableLimits(capacity_blocks=capacity, gap_hold_s=0.5, gap_keep_s=2.0)
    lazy, eager = PrefixTable(HASHER, limits), PrefixTable(HASHER, limits)
    now = 0.0
    for replica, which, ttl_s, tick in adds:
        now += 0.4 if tick else 0.0
        for t in (lazy, eager):
            t.add_speculative(replica, tuples[which], ttl_s, now)
        list(eager._holders)  # settles at once
        listed = {id(keys): keys for keys in lazy._touched.values()}
        assert lazy._touched_keys == sum(map(len, listed.values()))
    assert list(lazy._holders.items()) == list(eager._holders.items())
    assert lazy.counters == eager.counters


def test_compaction_keeps_every_live_expiry() -> None:
    """After a compaction the heap lists each live speculative key once, under its own expiry."""
    t = PrefixTable(HASHER, TableLimits(max_speculative_keys=8))
    first, second = tuple(HASHER.request_keys(list(range(8)))), tuple(HASHER.request_keys(list(range(9, 15))))
    t.add_speculative(A, first, 5.0, 0.0)
    t.add_speculative(A, first[:2], 9.0, 0.1)
    t.add_speculative(B, second, 5.0, 0.2)
    t._compact_spec_heap()
    listed = sorted((expiry_s, spec.replica, key) for expiry_s, _, spec, keys in t._spec_heap for key in keys)
    live = sorted(
        (expiry_s, replica, key)
        for replica, spec in t._slots.specs.items()
        for key, expiry_s in spec.expiry.items()
    )
    assert listed == live and len(live) == 7
    assert [entry[0] for entry in sorted(t._spec_heap)] == [5.0, 5.2, 9.1]
