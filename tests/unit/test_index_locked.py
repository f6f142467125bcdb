"""``LockedPrefixTable``: the same answers as a plain table, sliced applies, and safe sharing with a
thread that applies while this one matches (the ingest thread and the request loop)."""

from __future__ import annotations

import threading
import time

from fuzz_examples import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.events import Cleared, KvEvent, Removed, Resync, Stored
from balancer.index.hashing import BlockHasher, pack_tokens
from balancer.index.locked import LockedPrefixTable
from balancer.index.table import PrefixTable
from balancer.types import BlockKey, EngineHash, ReplicaId

BS = 4
HASHER = BlockHasher("m", BS)
A, B = ReplicaId("a"), ReplicaId("b")


def chain(first_hash: int, blocks: int, first_token: int) -> list[Stored]:
    """``blocks`` one-block ``Stored`` events chained by parent, as SGLang publishes them."""
    events = []
    for i in range(blocks):
        tokens = range(first_token + i * BS, first_token + (i + 1) * BS)
        parent = None if i == 0 else EngineHash(first_hash + i - 1)
        events.append(Stored(0, parent, (EngineHash(first_hash + i),), pack_tokens(tokens), BS))
    return events


def test_sliced_apply_gives_the_plain_tables_result() -> None:
    plain, locked = PrefixTable(HASHER), LockedPrefixTable(HASHER, apply_slice_blocks=3)
    events = [*chain(1, 20, 1), Removed(0, (EngineHash(20),))]
    assert locked.apply(A, events, 0.0) == plain.apply(A, events, 0.0)
    keys = HASHER.request_keys(list(range(1, 1 + 20 * BS)))
    assert locked.match(keys, None, 0.0).blocks == plain.match(keys, None, 0.0).blocks == {A: 19}
    assert locked.held_blocks(A) == 19
    assert locked.stats() == plain.stats()


def test_an_empty_apply_still_expires_speculative_entries() -> None:
    table = LockedPrefixTable(HASHER)
    keys = HASHER.request_keys(list(range(1, 1 + 4 * BS)))
    table.add_speculative(B, keys, 1.0, 0.0)
    assert table.match(keys, None, 0.5).blocks == {B: 4}
    table.apply(A, [], 2.0)
    assert not table.has_speculative


def test_a_thread_applying_while_another_matches_never_breaks_either() -> None:
    """The ingest thread stores and drops chains while this thread matches and speculates: no
    exception on either side, and every match sees a whole prefix (a multiple of nothing torn)."""
    table = LockedPrefixTable(HASHER, apply_slice_blocks=16)
    errors: list[BaseException] = []
    stop = threading.Event()

    def ingest() -> None:
        try:
            round_ = 0
            while not stop.is_set():
                table.apply(A, chain(1, 64, 1), float(round_))
                table.apply(A, [Removed(0, tuple(EngineHash(h) for h in range(1, 65)))], float(round_))
                round_ += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=ingest)
    thread.start()
    keys = HASHER.request_keys(list(range(1, 1 + 64 * BS)))
    seen: set[int] = set()
    deadline = time.monotonic() + 1.0
    try:
        while time.monotonic() < deadline:
            seen.add(table.match(keys, None, 0.0).blocks.get(A, 0))
            table.add_speculative(B, keys[:8], 0.001, 0.0)
            table.stats()
    finally:
        stop.set()
        thread.join(5.0)
    assert not errors
    assert seen <= set(range(65))
    assert len(seen) > 1  # the matcher really ran while the chains came and went


def test_every_public_method_of_the_table_is_overridden_under_the_lock() -> None:
    """A method added to ``PrefixTable`` (h-cheap's ``match_confirmed``, h-receipts' ``drop_blocks``)
    must be locked here too: the request loop and receipts call it while the ingest thread applies.
    The two properties read one attribute (atomic under the GIL)."""
    public = {
        name
        for cls in PrefixTable.__mro__[:-1]  # the table and its mixins (``GapRecovery``), not object
        for name, value in vars(cls).items()
        if not name.startswith("_") and callable(value) and not isinstance(value, (staticmethod, classmethod))
    }
    assert "settle_suspect" in public
    assert public - set(vars(LockedPrefixTable)) == set()


def _calls(table: LockedPrefixTable, keys: list[int]) -> dict[str, object]:
    typed = [BlockKey(key) for key in keys]
    return {
        "apply": lambda: table.apply(A, chain(1, 2, 1), 0.0),
        "match": lambda: table.match(keys, None, 0.0),
        "match_confirmed": lambda: table.match_confirmed(keys, None, 0.0),
        "prefix_holders": lambda: table.prefix_holders(list(range(1, 1 + 2 * BS)), 0.0),
        "add_speculative": lambda: table.add_speculative(B, keys, 10.0, 0.0),
        "add_shared_speculative": lambda: table.add_shared_speculative(B, keys, 10.0, 0.0),
        "drop_replica": lambda: table.drop_replica(B),
        "drop_blocks": lambda: table.drop_blocks(A, keys),
        "speculated": lambda: table.speculated(B, keys, 0.0),
        "drop_speculated": lambda: table.drop_speculated(A, keys, 0.0),
        "held_blocks": lambda: table.held_blocks(A),
        "held_roots": lambda: table.held_roots(None, 0.0),
        "settle_suspect": lambda: table.settle_suspect(A, typed, (), 0.0),
        "suspect_blocks": lambda: table.suspect_blocks(A),
        "engine_hashes": lambda: table.engine_hashes(A),
        "held_keys": lambda: table.held_keys(A, 10),
        "learn_blocks": lambda: table.learn_blocks(A, typed, [1, 2], 0.0, hold=True),
        "held_prefix": lambda: table.held_prefix(A, typed),
        "routes_wanted": lambda: table.routes_wanted(A, 0.0),
        "note_routes": lambda: table.note_routes(A, typed, list(range(2 * BS)), lambda t, bs: [1, 2], 0.0),
        "stats": lambda: table.stats,
    }


def test_each_call_waits_for_the_lock() -> None:
    """Each public call blocks while another thread holds the table's lock, and runs once it is
    released (``drop_speculated`` too: its two steps under one hold, the lock not reentrant)."""
    table = LockedPrefixTable(HASHER)
    keys = HASHER.request_keys(list(range(1, 1 + 2 * BS)))
    calls = _calls(table, keys)
    assert set(calls) >= {
        n for n, v in vars(LockedPrefixTable).items() if callable(v) and not n.startswith("_")
    }
    for name, call in calls.items():
        done = threading.Event()

        def run(call: object = call, done: threading.Event = done) -> None:
            result = call()  # type: ignore[operator]
            if callable(result):
                result()
            done.set()

        with table.lock:
            thread = threading.Thread(target=run)
            thread.start()
            assert not done.wait(0.05), f"{name} ran while the lock was held"
        assert done.wait(5.0), f"{name} did not run once the lock was free"
        thread.join(5.0)


def test_drop_speculated_drops_only_the_keys_not_stored_again_since() -> None:
    """The receipts' drop: of the stale keys, those the engine confirmed by a store since the routing
    stay; the others' real holdings go (the speculative entries stay)."""
    for table in (PrefixTable(HASHER), LockedPrefixTable(HASHER)):
        events = chain(1, 4, 1)
        keys = HASHER.request_keys(list(range(1, 1 + 4 * BS)))
        table.apply(A, events[:2], 0.0)  # blocks 0-1 stored
        table.add_speculative(A, keys, 10.0, 0.0)  # routed: 2-3 speculative
        table.apply(A, events[2:3], 0.0)  # block 2 stored since: confirmed
        assert table.speculated(A, keys, 0.0) == [keys[0], keys[1], keys[3]]  # 2 was stored since
        assert table.drop_speculated(A, keys[1:], 0.0) == 1  # 1's real holding; 3 had none
        # the speculative slot holds all four to its expiry: a store confirms a key, it does not take it
        assert table.match(keys, None, 0.0).blocks == {A: 4}
        assert table.match_confirmed(keys, None, 0.0)[1] == {A: 1}


class _CountingLock:
    """A real lock that counts its holds (how many slices an apply took)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds = 0

    def __enter__(self) -> bool:
        self._lock.acquire()
        self.holds += 1
        return True

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_slice_counts_each_events_own_cost_besides_its_blocks() -> None:
    """One-block events cost ``1 + event_cost_blocks`` each: 20 of them in slices of 12 are 10 holds
    of the lock (2 events each), where counting blocks alone made 2 holds (12 + 8 events)."""
    for cost, holds in ((5, 10), (0, 2)):
        table = LockedPrefixTable(HASHER, apply_slice_blocks=12, event_cost_blocks=cost)
        lock = _CountingLock()
        table.lock = lock  # type: ignore[assignment]
        result = table.apply(A, chain(1, 20, 1), 0.0)
        assert (lock.holds, result.stored_blocks) == (holds, 20)
    table = LockedPrefixTable(HASHER, apply_slice_blocks=12, event_cost_blocks=5)
    table.lock = lock = _CountingLock()  # type: ignore[assignment]
    big = Stored(0, None, tuple(EngineHash(h) for h in range(1, 31)), pack_tokens(range(1, 1 + 30 * BS)), BS)
    table.apply(A, [big, *chain(100, 1, 10_000)], 0.0)
    assert lock.holds == 2  # an event over the slice is one slice of its own


_HASHES = st.integers(min_value=1, max_value=40).map(EngineHash)


@st.composite
def _events(draw: st.DrawFn) -> list[KvEvent]:
    """Stores (chained under a hash stored earlier or rooted), removals, clears and resyncs of two
    DP ranks, with 1-6 blocks per store."""
    events: list[KvEvent] = []
    for _ in range(draw(st.integers(min_value=0, max_value=30))):
        rank = draw(st.integers(min_value=0, max_value=1))
        kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "cleared", "resync"]))
        if kind == "stored":
            count = draw(st.integers(min_value=1, max_value=6))
            hashes = tuple(draw(st.lists(_HASHES, min_size=count, max_size=count, unique=True)))
            parent = draw(st.one_of(st.none(), _HASHES))
            first = draw(st.integers(min_value=0, max_value=50))
            events.append(Stored(rank, parent, hashes, pack_tokens(range(first, first + count * BS)), BS))
        elif kind == "removed":
            events.append(Removed(rank, tuple(draw(st.lists(_HASHES, min_size=1, max_size=4)))))
        elif kind == "cleared":
            events.append(Cleared(rank))
        else:
            events.append(Resync(rank, "overflow"))
    return events


@settings(max_examples=examples(300), deadline=None)
@given(
    batches=st.lists(_events(), min_size=1, max_size=4),
    slice_blocks=st.integers(min_value=1, max_value=40),
    event_cost=st.integers(min_value=0, max_value=8),
)
def test_a_sliced_apply_leaves_exactly_the_plain_tables_contents(
    batches: list[list[KvEvent]], slice_blocks: int, event_cost: int
) -> None:
    """Property: whatever the slice size and per-event cost, a ``LockedPrefixTable`` fed the same
    batches returns the same results and holds the same blocks as an unsliced ``PrefixTable``."""
    plain = PrefixTable(HASHER)
    locked = LockedPrefixTable(HASHER, apply_slice_blocks=slice_blocks, event_cost_blocks=event_cost)
    for now, events in enumerate(batches):
        assert locked.apply(A, events, float(now)) == plain.apply(A, events, float(now))
    assert locked.stats() == plain.stats()
    assert locked.held_blocks(A) == plain.held_blocks(A)
    for rank in (0, 1):
        assert locked.engine_hashes(A, rank) == plain.engine_hashes(A, rank)
    for first in range(0, 51):
        keys = HASHER.request_keys(list(range(first, first + 12 * BS)))
        assert locked.match(keys, None, 9.0).blocks == plain.match(keys, None, 9.0).blocks
