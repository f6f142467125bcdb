"""Speculative re-adds whose expiry writes wait in the slot's log, against writing them at each add.

``add_speculative`` of a chain every key of which the replica's speculative slot holds (the same
request's first-token add, or a chain whose match saw the slot's bit on every key) only logs the new
expiry (``SpecSlot.defer``); the log is applied before anything reads or removes an expiry, each key
once with its newest listing's. The table, each slot's expiries (and their order), the expiry heap,
the counters and every match must end as with every add written at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.events import Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.slots import SpecSlot, TableLimits
from balancer.index.table import PrefixTable
from balancer.types import EngineHash, ReplicaId

BS = 2
HASHER = BlockHasher("m", BS)
A, B = ReplicaId("a"), ReplicaId("b")
_PROMPTS = (
    list(range(1, 13)),
    list(range(100, 112)),
    [*range(1, 7), *range(200, 206)],
    [*range(1, 7), *range(300, 306)],
)
_CHAINS = tuple(HASHER.request_keys(p) for p in _PROMPTS)


class _EagerTable(PrefixTable):
    """Every add writes its expiries at once: no slot ever notes a chain's held prefix."""

    def _note_held(self, keys: tuple[int, ...], walk: list[tuple[int, int]], spec_mask: int) -> None:
        return None

    def add_speculative(self, replica: ReplicaId, keys: Sequence[int], ttl_s: float, now: float) -> None:
        super().add_speculative(replica, keys, ttl_s, now)
        for spec in self._slots.specs.values():
            assert not spec.deferred
            spec.held.clear()


_OPS = st.one_of(
    st.tuples(  # a routed request: a prefix of a prompt's keys, as a tuple reused by later ops
        st.just("add"),
        st.sampled_from((A, B)),
        st.integers(0, len(_CHAINS) - 1),
        st.integers(0, 6),
        st.sampled_from((0.5, 3.0, 30.0)),
    ),
    st.tuples(  # the router's way: the match, then the add of the same tuple
        st.just("route"),
        st.sampled_from((A, B)),
        st.integers(0, len(_CHAINS) - 1),
        st.integers(1, 6),
        st.sampled_from((3.0, 30.0)),
    ),
    st.tuples(st.just("again"), st.integers(0, 7), st.sampled_from((0.5, 3.0))),  # a first token
    st.tuples(st.just("match"), st.integers(0, len(_CHAINS) - 1), st.integers(1, 6)),
    st.tuples(
        st.just("store"), st.sampled_from((A, B)), st.integers(0, len(_PROMPTS) - 1), st.integers(1, 6)
    ),
    st.tuples(st.just("remove"), st.sampled_from((A, B)), st.integers(0, 40)),
    st.tuples(st.just("gap"), st.sampled_from((A, B))),
    st.tuples(st.just("drop"), st.sampled_from((A, B))),
    st.tuples(st.just("drop_blocks"), st.sampled_from((A, B)), st.integers(0, len(_CHAINS) - 1)),
    st.tuples(st.just("tick"), st.sampled_from((0.25, 1.0, 4.0))),
)


class _Run:
    """One table driven by the ops; the chains it routed are kept (their identity matters)."""

    def __init__(self, t: PrefixTable) -> None:
        self.t = t
        self.routed: list[tuple[ReplicaId, tuple[int, ...]]] = []
        self.chains = {(c, d): tuple(_CHAINS[c][:d]) for c in range(len(_CHAINS)) for d in range(7)}

    def op(self, op: tuple[object, ...], now: float) -> object:
        t, kind = self.t, op[0]
        if kind in ("add", "route"):
            _, replica, chain, depth, ttl = op
            keys = self.chains[(int(chain), int(depth))]  # type: ignore[call-overload]
            found = t.match_confirmed(keys, None, now) if kind == "route" else None
            t.add_speculative(replica, keys, float(ttl), now)  # type: ignore[arg-type]
            self.routed.append((replica, keys))  # type: ignore[arg-type]
            return found
        if kind == "again":
            if not self.routed:
                return None
            replica, keys = self.routed[int(op[1]) % len(self.routed)]  # type: ignore[call-overload]
            t.add_speculative(replica, keys, float(op[2]), now)  # type: ignore[arg-type]
            return None
        if kind == "match":
            keys = self.chains[(int(op[1]), int(op[2]))]  # type: ignore[call-overload]
            return t.match_confirmed(keys, None, now)
        if kind == "store":
            _, replica, prompt, count = op
            engine = tuple(EngineHash(int(prompt) * 10 + i) for i in range(int(count)))  # type: ignore[call-overload]
            tokens = _PROMPTS[int(prompt)][: int(count) * BS]  # type: ignore[call-overload]
            return t.apply(replica, [Stored(0, None, engine, pack_tokens(tokens), BS)], now)  # type: ignore[arg-type]
        if kind == "remove":
            return t.apply(op[1], [Removed(0, (EngineHash(int(op[2])),))], now)  # type: ignore[arg-type, call-overload]
        if kind == "gap":
            return t.apply(op[1], [Resync(0, "gap")], now)  # type: ignore[arg-type]
        if kind == "drop":
            return t.drop_replica(op[1])  # type: ignore[arg-type]
        if kind == "drop_blocks":
            return t.drop_speculated(op[1], _CHAINS[int(op[2])], now)  # type: ignore[arg-type, call-overload]
        return None


def _expiries(t: PrefixTable, replica: ReplicaId) -> list[tuple[int, float]] | None:
    spec = t._slots.specs.get(replica)
    return None if spec is None else list(spec.expiry.items())


@settings(max_examples=500, deadline=None)
@given(
    st.lists(_OPS, max_size=50),
    st.sampled_from((8, 12, 64)),
    st.sampled_from((0, 4, 12, 1000)),
    st.booleans(),
)
def test_logged_expiries_end_as_written_at_each_add(
    ops: list[tuple[object, ...]], capacity: int, cap: int, frontier: bool
) -> None:
    """Routed chains added again (first tokens), matched (which lists the chains a slot holds
    whole), confirmed by stores, removed, dropped, evicted over the capacity, refused over
    ``max_speculative_keys``, expired as time passes, after event gaps: the same as the eager table."""
    gap = {"gap_hold_s": 0.5, "gap_keep_s": 2.0} if frontier else {}
    limits = TableLimits(capacity_blocks=capacity, max_speculative_keys=cap, **gap)  # type: ignore[arg-type]
    lazy, eager = _Run(PrefixTable(HASHER, limits)), _Run(_EagerTable(HASHER, limits))
    now = 0.0
    for op in ops:
        if op[0] == "tick":
            now += float(op[1])  # type: ignore[arg-type]
            continue
        assert lazy.op(op, now) == eager.op(op, now)
        for replica in (A, B):  # every read of the expiries applies the log: compare only at times
            if op[0] == "store":
                assert _expiries(lazy.t, replica) == _expiries(eager.t, replica)
    for chain in _CHAINS:
        keys = tuple(chain)
        assert lazy.t.match_confirmed(keys, None, now) == eager.t.match_confirmed(keys, None, now)
    assert list(lazy.t._holders.items()) == list(eager.t._holders.items())
    assert lazy.t.counters == eager.t.counters
    assert lazy.t.stats().speculative_entries == eager.t.stats().speculative_entries
    for replica in (A, B):
        assert _expiries(lazy.t, replica) == _expiries(eager.t, replica)
    assert [(e, keys) for e, _, _, keys in sorted(lazy.t._spec_heap)] == [
        (e, keys) for e, _, _, keys in sorted(eager.t._spec_heap)
    ]
    later = now + 100.0  # everything expires: the same keys go at the same times
    lazy.t.match_confirmed((), None, later), eager.t.match_confirmed((), None, later)
    assert list(lazy.t._holders.items()) == list(eager.t._holders.items())
    assert lazy.t.counters == eager.t.counters


def test_a_first_token_add_is_logged_and_applied_with_its_newest_expiry() -> None:
    """The same tuple added twice is logged once it is listed; the newest expiry wins, a chain
    sharing its prefix keeps its own expiry for its own keys, and a match lists a chain whole."""
    t = PrefixTable(HASHER, TableLimits())
    first, shared = tuple(_CHAINS[2]), tuple(_CHAINS[3])
    t.add_speculative(A, first, 30.0, 0.0)
    spec = t._slots.specs[A]
    assert spec.held[id(first)] == (first, len(first)) and not spec.deferred
    t.add_speculative(A, first, 2.0, 0.5)
    assert list(spec.deferred.values()) == [(first, 2.5)]
    t.add_speculative(A, shared, 30.0, 0.6)  # not listed: written, and logged as the newest
    assert list(spec.deferred.values()) == [(first, 2.5), (shared, 30.6)]
    assert [spec.pending[k] for k in shared] == [30.6] * len(shared)
    t.match_confirmed(shared, None, 0.7)
    t.add_speculative(A, shared, 2.0, 0.8)
    t.add_speculative(A, first, 2.0, 0.9)
    assert list(spec.deferred.values()) == [(shared, 2.8), (first, 2.9)]  # one entry a chain
    expiry = spec.expiry  # applies the log
    assert not spec.deferred and not spec.held
    assert [expiry[k] for k in first] == [2.9] * len(first)
    assert [expiry[k] for k in shared[3:]] == [2.8] * (len(shared) - 3)


def test_the_slot_applies_its_log_past_its_bound() -> None:
    """A chain logged again counts once; past ``max_keys`` the log is applied, newest wins."""
    slot = SpecSlot(A, 0)
    first, second = (1, 2, 3), (2, 3, 4)
    slot.pending = dict.fromkeys((1, 2, 3, 4), 1.0)
    slot.defer(first, 2.0, max_keys=5)
    slot.defer(first, 2.5, max_keys=5)
    assert slot.deferred_keys == 3 and slot.pending == dict.fromkeys((1, 2, 3, 4), 1.0)
    slot.defer(second, 3.0, max_keys=5)
    assert not slot.deferred and slot.pending == {1: 2.5, 2: 3.0, 3: 3.0, 4: 3.0}


def test_a_lease_writes_only_the_keys_past_the_prefix_its_match_saw_held() -> None:
    """A chain sharing a held prefix: its match notes how far the slot holds it; its add writes
    the keys past that prefix at once (the new ones get the slot's bit) and logs the prefix's."""
    t = PrefixTable(HASHER, TableLimits())
    first, shared = tuple(_CHAINS[2]), tuple(_CHAINS[3])  # 3 leading keys in common
    t.add_speculative(A, first, 30.0, 0.0)
    spec = t._slots.specs[A]
    overlap, _ = t.match_confirmed(shared, None, 0.5)
    assert overlap.blocks[A] == 3 and spec.held[id(shared)] == (shared, 3)
    t.add_speculative(A, shared, 30.0, 1.0)
    assert [spec.pending[k] for k in shared] == [30.0] * 3 + [31.0] * (len(shared) - 3)
    assert list(spec.deferred.values()) == [(shared, 31.0)]
    assert t.match_confirmed(shared, None, 1.0)[0].blocks[A] == len(shared)
    assert [spec.expiry[k] for k in shared] == [31.0] * len(shared)
    assert [spec.expiry[k] for k in first[3:]] == [30.0] * (len(first) - 3)


_LOG = st.lists(
    st.tuples(st.integers(0, len(_CHAINS) - 1), st.integers(1, 6), st.sampled_from((1.0, 2.0, 3.5))),
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(_LOG, st.booleans())
def test_each_key_gets_its_newest_listing_whichever_way_the_log_is_applied(
    log: list[tuple[int, int, float]], fresh_tuples: bool
) -> None:
    """Chains with shared prefixes (the same tuple again, or an equal new one), logged in any order:
    finding each key's newest listing first gives what writing the chains in turn gives."""
    chains = {(c, d): tuple(_CHAINS[c][:d]) for c in range(len(_CHAINS)) for d in range(1, 7)}
    merged, in_turn = SpecSlot(A, 0), SpecSlot(A, 0)
    for slot in (merged, in_turn):
        slot.pending = dict.fromkeys([key for chain in _CHAINS for key in chain], 0.0)
        for c, d, expiry_s in log:
            chain = tuple(list(chains[(c, d)])) if fresh_tuples else chains[(c, d)]
            slot.defer(chain, expiry_s, max_keys=10**6)
    merged.settle(in_turn=0)
    in_turn.settle(in_turn=len(log))
    assert list(merged.pending.items()) == list(in_turn.pending.items())
